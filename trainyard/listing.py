"""Listing a channel: which objects it holds, as S3 describes them (size, ETag, the version pinned).

A channel is every object under a prefix (Spark's and Hadoop's side files left out), one object, or
the objects a manifest names: a JSON or JSON-lines list of ``s3://`` URIs, or SageMaker's
``[{"prefix": ...}, "key", ...]``. An entry may pin a version (``s3://b/k?versionId=...``, or
``{"s3_uri": ..., "version_id": ...}``). Every key must stay inside the channel's folder once laid
out on disk. The listing's digest (bucket, key, size, ETag and the pinned version of every object) is
the channel's data lineage.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from urllib.parse import unquote

from botocore.exceptions import BotoCoreError, ClientError

from trainyard import parallel, s3
from trainyard.errors import DataError, StorageError
from trainyard.spec import Channel

MAX_CONCURRENT_OBJECTS = 16  # requests in flight: HEADs here, GETs in staging


@dataclass(slots=True)
class StagedObject:
    """One object of a channel: as S3 lists it, how it was verified, and where it lies in the cache."""

    bucket: str
    key: str
    size: int
    etag: str
    rel: str = ""
    checksum: dict | None = None
    verified_by: str = ""
    path: str = ""
    version_id: str = ""  # the version a manifest pinned; "" for the latest

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}" + (f"?versionId={self.version_id}" if self.version_id else "")

    @property
    def version(self) -> dict:
        """The ``VersionId`` argument of S3 calls that read this object: the pinned one, else none."""
        return {"VersionId": self.version_id} if self.version_id else {}


@dataclass(slots=True)
class ChannelManifest:
    """What a channel held when it was staged, and where each object now lies."""

    name: str
    uri: str
    format: str
    objects: list[StagedObject] = field(default_factory=list)
    bytes: int = 0
    bytes_downloaded: int = 0
    objects_downloaded: int = 0
    digest: str = ""
    # With TRAINYARD_CACHE_VERIFY: objects whose cached copy no longer matched what was checked when it was
    # fetched, and those kept with nothing to check it against (an older Trainyard's, or on a file system
    # without extended attributes): both fetched again
    cache_mismatches: list[str] = field(default_factory=list)
    cache_unverifiable: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """The channel's entry in the job summary's ``data.channels``."""
        verified: dict[str, int] = {}
        for obj in self.objects:
            verified[obj.verified_by] = verified.get(obj.verified_by, 0) + 1
        return {
            "uri": self.uri,
            "objects": len(self.objects),
            "bytes": self.bytes,
            "bytes_downloaded": self.bytes_downloaded,
            "objects_downloaded": self.objects_downloaded,
            "manifest_digest": self.digest,
            "verified_by": verified,
        } | {
            k: v
            for k, v in [("cache_mismatches", self.cache_mismatches), ("cache_unverifiable", self.cache_unverifiable)]
            if v
        }

    def to_dict(self) -> dict:
        return asdict(self)

    def lineage(self) -> dict:
        """What the channel held, object by object, without where this machine cached it: the record a
        registered version keeps of the data it was trained on (``<channel>.objects.json`` in its run),
        which ``digest`` is the sha256 of (bucket, key, size, ETag, version)."""
        keep = ("bucket", "key", "size", "etag", "version_id", "checksum", "verified_by")
        objects = [{k: getattr(o, k) for k in keep} for o in self.objects]
        channel = {"channel": self.name, "uri": self.uri, "format": self.format, "digest": self.digest}
        return channel | {"bytes": self.bytes, "objects": objects}

    @classmethod
    def from_dict(cls, data: dict) -> ChannelManifest:
        return cls(**{**data, "objects": [StagedObject(**o) for o in data.get("objects", [])]})


def list_channel(name: str, channel: Channel) -> ChannelManifest:
    """List a channel's objects: every object under a prefix, one object, or those a manifest names."""
    try:
        if channel.s3_data_type == "manifest":
            objects = _list_manifest(channel.s3_uri)
        else:
            objects = _list_prefix(channel.s3_uri, raw=channel.format == "raw")
    except (ClientError, BotoCoreError) as exc:
        raise s3.describe_error(exc, channel.s3_uri) from exc
    if not objects:
        raise DataError(f"channel {name!r}: no objects under {channel.s3_uri}; check the prefix and upload the data")
    for obj in objects:
        check_relative_key(obj.rel, obj.uri)
    objects.sort(key=lambda o: (o.bucket, o.key))
    manifest = ChannelManifest(name=name, uri=channel.s3_uri, format=channel.format, objects=objects)
    manifest.bytes = sum(o.size for o in objects)
    manifest.digest = lineage_digest(objects)
    return manifest


def check_relative_key(rel: str, uri: str, manifest: str | None = None) -> None:
    """Refuse keys that would escape the channel's folder if laid out on disk (``manifest``: the manifest
    that lists the object, whose entry is then the thing to fix)."""
    parts = rel.split("/")
    if not rel or "\x00" in rel or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        unsafe = "unsafe key (empty, '.' or '..' segments, an absolute path, a backslash or NUL)"
        if manifest is not None:
            raise DataError(f"{manifest}: its entry {uri} has an {unsafe}; fix the entry in the manifest")
        raise DataError(f"{uri}: {unsafe}; rename the object in S3")


def _list_prefix(uri: str, raw: bool = False) -> list[StagedObject]:
    """Every data object under a prefix (``_is_data_key``), or the one object it names."""
    root = s3.S3Uri.parse(uri)
    client = s3.client()
    denied: ClientError | None = None
    if root.key and not root.key.endswith("/"):
        # "s3://bucket/key" may name one object; otherwise it is a prefix written without its slash.
        try:
            head = client.head_object(Bucket=root.bucket, Key=root.key)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403:
                # A role that may read only what is under "key/" is refused the HEAD of "key" itself (S3 answers
                # 403, not 404, to a HEAD without s3:ListBucket): taken as the prefix, unless nothing is under it.
                denied = exc
            elif exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise
        else:
            # An object that is also a folder of objects: staging either alone would lose the other silently.
            # (folder markers and side files under it do not count; the pages are read up to the first data
            # key: a Spark folder's .crc side files sort first, more than a page of them in a large one)
            under = _first_data_key(client, root.bucket, root.key + "/", raw)
            if under:
                raise DataError(
                    f"{uri} is an object and also a prefix of objects (s3://{root.bucket}/{under}, ...); end "
                    "the URI with '/' for the objects under it, or list the one object in a manifest "
                    "(s3_data_type: manifest)"
                )
            rel = root.key.rsplit("/", 1)[-1]
            return [StagedObject(root.bucket, root.key, head["ContentLength"], head["ETag"].strip('"'), rel)]
    prefix = root.key if not root.key or root.key.endswith("/") else root.key + "/"
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=root.bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            rel = item["Key"][len(prefix) :]
            if _is_data_key(rel, raw):
                objects.append(StagedObject(root.bucket, item["Key"], item["Size"], item["ETag"].strip('"'), rel))
    if not objects and denied is not None:
        raise denied  # no prefix of objects: the URI named an object this role may not read
    return objects


def _first_data_key(client, bucket: str, prefix: str, raw: bool) -> str | None:
    """The first data object's key under ``prefix`` (``_is_data_key``), or None; None too where listing is
    refused (a role that may read the object but not list the bucket: it named an object)."""
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if _is_data_key(item["Key"][len(prefix) :], raw):
                    return item["Key"]
    except ClientError as exc:
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 403:
            raise
    return None


def _list_manifest(uri: str) -> list[StagedObject]:
    """A manifest: a JSON list of s3:// URIs, SageMaker's ``[{"prefix": ...}, "rel", ...]``, or JSONL."""
    where = s3.S3Uri.parse(uri)
    client = s3.client()
    try:
        # utf-8-sig: a byte order mark (Windows editors write one) is not part of the JSON
        text = client.get_object(Bucket=where.bucket, Key=where.key)["Body"].read().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{uri}: a manifest must be UTF-8 JSON or JSON lines ({exc})") from exc
    try:
        entries = json.loads(text)
    except json.JSONDecodeError:
        try:
            entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise DataError(f"{uri}: a manifest must be a JSON list or JSON lines of s3:// URIs ({exc})") from exc
    if not isinstance(entries, list):
        entries = [entries]  # JSON lines with a single line
    prefix = None
    if entries and isinstance(entries[0], dict) and "prefix" in entries[0]:
        prefix, entries = entries[0]["prefix"], entries[1:]
        if not isinstance(prefix, str) or not prefix.startswith("s3://"):
            raise DataError(
                f"{uri}: the manifest's prefix {prefix!r} is not an s3:// URI; write it as s3://bucket/prefix/"
            )
        if not entries:
            raise DataError(f"{uri}: the manifest has a prefix entry and no objects after it; list the objects' keys")
    parsed = []
    for entry in entries:
        value = entry.get("s3_uri") if isinstance(entry, dict) else entry
        if not isinstance(value, str):
            raise DataError(f"{uri}: manifest entry {entry!r} is not an s3:// URI or a key")
        value, version = _split_version(value)
        version = str(entry.get("version_id") or version) if isinstance(entry, dict) else version
        if prefix and value.startswith("s3://"):
            raise DataError(
                f"{uri}: manifest entry {value!r} is a full URI, but after the manifest's prefix entries are keys "
                f"relative to it; write it without {prefix!r}, or drop the prefix entry"
            )
        if not prefix and not value.startswith("s3://"):
            raise DataError(
                f"{uri}: manifest entry {value!r} is a key, but the manifest has no prefix entry to say where; write "
                'it as s3://bucket/key, or begin the manifest with {"prefix": "s3://bucket/prefix/"}'
            )
        if value.endswith("/"):
            raise DataError(
                f"{uri}: manifest entry {value!r} is a folder; a manifest lists objects (list the folder's "
                "objects, or make the channel a prefix)"
            )
        parsed.append((s3.S3Uri.parse(prefix + value if prefix else value), version))
    seen: set[s3.S3Uri] = set()
    for target, _ in parsed:
        if target in seen:  # both would be laid out at one path, whatever their versions
            raise DataError(f"{uri}: the manifest lists {target} more than once; list each object once")
        seen.add(target)
        # before any request: S3 would answer "no such object" for most unsafe keys, hiding why
        check_relative_key(_manifest_rel(target, prefix), str(target), manifest=uri)

    def described(entry: tuple[s3.S3Uri, str]) -> StagedObject:
        target, version = entry
        return head(client, target, _manifest_rel(target, prefix), version)

    return parallel.map_in_threads(described, parsed, MAX_CONCURRENT_OBJECTS)


def _manifest_rel(target: s3.S3Uri, prefix: str | None) -> str:
    """Where a manifest's object is laid out in the channel's folder: its key after the manifest's
    prefix, or bucket/key. A prefix is joined to its entries as written (SageMaker's rule), so one
    without a closing slash (``s3://b/d`` with ``/a.csv``, or ``s3://b/da`` with ``ta.csv``) counts
    from the last slash in it: the keys ``d/a.csv`` and ``data.csv``."""
    if not prefix:
        return f"{target.bucket}/{target.key}"
    folder = s3.S3Uri.parse(prefix).key
    return target.key[folder.rfind("/") + 1 :]


def _split_version(value: str) -> tuple[str, str]:
    """``s3://b/k?versionId=v`` (or a prefix-relative ``k?versionId=v``) as ``("s3://b/k", "v")``, the
    version percent-decoded (the form S3's console links to a version with); anything else as
    ``(value, "")``. A key that itself ends in ``?versionId=...`` needs the manifest's
    ``{"s3_uri": ..., "version_id": ...}`` form instead."""
    match = re.fullmatch(r"(.+)\?versionId=([^&?]+)", value)
    return (match[1], unquote(match[2])) if match else (value, "")


def head(client, target: s3.S3Uri, rel: str = "", version_id: str = "") -> StagedObject:
    """One object (or one version of it) as S3 describes it (HEAD), for objects not found by listing a prefix."""
    obj = StagedObject(target.bucket, target.key, 0, "", rel, version_id=version_id)
    try:
        meta = client.head_object(Bucket=target.bucket, Key=target.key, **obj.version)
    except ClientError as exc:
        error = s3.describe_error(exc, obj.uri)
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            # a HEAD's 404 has no body to say which: no such bucket, no such object, or no such version
            if s3.bucket_missing(client, target.bucket):
                error = StorageError(
                    f"{obj.uri}: bucket {target.bucket!r} does not exist; create it or fix the bucket name"
                )
            elif obj.version_id and _exists(client, target):
                error = StorageError(
                    f"{obj.uri}: the object has no version {obj.version_id!r}; check the version id "
                    "(aws s3api list-object-versions lists them)"
                )
        raise error from exc
    if wrong := wrong_version(obj, meta):
        raise wrong
    obj.size, obj.etag = meta["ContentLength"], meta["ETag"].strip('"')
    return obj


def _exists(client, target: s3.S3Uri) -> bool:
    """Whether the object's latest version is there (a HEAD), to tell a missing version from a missing object."""
    try:
        client.head_object(Bucket=target.bucket, Key=target.key)
    except ClientError:
        return False
    return True


def wrong_version(obj: StagedObject, response: dict) -> StorageError | None:
    """The error when S3 did not answer for the version ``obj`` pins: an endpoint that keeps no versions
    (rclone) ignores ``VersionId`` and answers for the latest, whose bytes would be staged as the pinned ones."""
    # The "null" version (stored before versioning was on) comes without the header, on S3 and moto alike
    answered = response.get("VersionId") or ("null" if obj.version_id == "null" else None)
    if obj.version_id and answered != obj.version_id:
        sent = f"version {response['VersionId']}" if response.get("VersionId") else "no version id"
        return StorageError(
            f"{obj.uri}: S3 answered with {sent}, not the version pinned; "
            "the endpoint may not keep object versions (use one that does, or unpin it)"
        )
    return None


def _is_data_key(rel: str, raw: bool = False) -> bool:
    """Whether a key (relative to the channel's prefix) is data: folder markers (``dir/``, EMR's
    ``dir_$folder$``) are not, nor, in a table's channel, Spark/Hadoop side files and folders
    (``_SUCCESS``, ``.part-0.crc``, ``_temporary/``, ``.spark-staging-1/``). A ``raw`` channel keeps
    them: a custom entrypoint's ``_config.json`` or ``.vocab`` is its data, as SageMaker copies every
    object under the prefix. ``.`` and ``..`` are left in, for ``check_relative_key`` to refuse by name."""
    parts = rel.split("/")
    if not parts[-1] or parts[-1].endswith("_$folder$"):  # the folder markers of Hadoop's s3n and EMR
        return False
    return raw or not any(p.startswith(("_", ".")) and p not in (".", "..") for p in parts)


def lineage_digest(objects: list[StagedObject]) -> str:
    """The channel's data lineage: a hash of every object's bucket, key, size, ETag and pinned version."""
    h = hashlib.sha256()
    for obj in objects:
        version = f"\0{obj.version_id}" if obj.version_id else ""  # unpinned digests stay as they were
        h.update(f"{obj.bucket}\0{obj.key}\0{obj.size}\0{obj.etag}{version}\n".encode())
    return "sha256:" + h.hexdigest()
