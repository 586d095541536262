"""Stage 1, staging: list, fetch and verify a channel's objects from S3 into a content-addressed cache.

Each object is cached under a name derived from (bucket, key, ETag), so an unchanged object is
never fetched twice and an object changed in place is fetched again. A download lands under a
temporary name and is renamed only once its size (and MD5, for single-part objects) matches what
S3 reported. The channel's manifest (objects, sizes, ETags, local paths, and a digest of it all)
is the data lineage later stages record.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from boto3.exceptions import S3TransferFailedError
from botocore.exceptions import BotoCoreError, ClientError

from trainyard import progress, s3
from trainyard.errors import DataError
from trainyard.home import cache_dir, write_json_atomic
from trainyard.spec import Channel

MAX_CONCURRENT_OBJECTS = 8
ProgressFn = Callable[[int], None]


@dataclass(slots=True)
class StagedObject:
    """One object of a channel, as listed and as cached."""

    key: str
    size: int
    etag: str
    path: str = ""


@dataclass(slots=True)
class ChannelManifest:
    """What a channel held when it was staged, and where each object now lies."""

    name: str
    uri: str
    format: str
    objects: list[StagedObject] = field(default_factory=list)
    bytes: int = 0
    bytes_downloaded: int = 0
    digest: str = ""

    def summary(self) -> dict:
        """The channel's entry in the job summary's ``data.channels``."""
        return {
            "uri": self.uri,
            "objects": len(self.objects),
            "bytes": self.bytes,
            "bytes_downloaded": self.bytes_downloaded,
            "manifest_digest": self.digest,
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ChannelManifest:
        objects = [StagedObject(**o) for o in data.get("objects", [])]
        return cls(**{**data, "objects": objects})


def list_channel(name: str, channel: Channel) -> tuple[ChannelManifest, s3.S3Uri]:
    """List the channel's objects (a single key, or every object under a prefix)."""
    root = s3.S3Uri.parse(channel.s3_uri)
    client = s3.client()
    objects: list[StagedObject] = []
    prefix = root.key if (root.key == "" or root.key.endswith("/")) else root.key + "/"
    try:
        if root.key and not root.key.endswith("/"):
            # "s3://bucket/key" may name one object; otherwise it is a prefix without its slash.
            try:
                head = client.head_object(Bucket=root.bucket, Key=root.key)
                objects.append(StagedObject(root.key, head["ContentLength"], head["ETag"].strip('"')))
                prefix = root.key.rsplit("/", 1)[0] + "/" if "/" in root.key else ""
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                    raise
        if not objects:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=root.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    if _is_data_key(item["Key"]):
                        objects.append(StagedObject(item["Key"], item["Size"], item["ETag"].strip('"')))
    except (ClientError, BotoCoreError) as exc:
        raise s3.describe_error(exc, channel.s3_uri) from exc
    if not objects:
        raise DataError(f"channel {name!r}: no objects under {channel.s3_uri}; check the prefix and upload the data")
    for obj in objects:
        _check_relative_key(obj.key, prefix, channel.s3_uri)
    objects.sort(key=lambda o: o.key)
    manifest = ChannelManifest(name=name, uri=channel.s3_uri, format=channel.format, objects=objects)
    manifest.bytes = sum(o.size for o in objects)
    return manifest, s3.S3Uri(root.bucket, prefix)


def stage_channels(channels: dict[str, Channel], manifest_dir: Path) -> dict[str, ChannelManifest]:
    """Stage every channel with a progress bar; write each manifest to ``manifest_dir/<name>.json``."""
    manifests = {}
    for name, channel in channels.items():
        manifest, root = list_channel(name, channel)
        with progress.bar(f"staging {name} ({len(manifest.objects)} objects)", manifest.bytes, "bytes") as advance:
            manifests[name] = fetch_channel(manifest, root, advance)
        write_json_atomic(manifest_dir / f"{name}.json", manifests[name].to_dict())
    return manifests


def fetch_channel(manifest: ChannelManifest, root: s3.S3Uri, on_bytes: ProgressFn | None = None) -> ChannelManifest:
    """Fetch every listed object into the cache, verified; fill in paths, bytes moved and the digest.

    ``on_bytes`` is called with each chunk of bytes transferred (for a progress bar).
    """
    client = s3.client()
    objects_dir = cache_dir() / "objects"

    def fetch(obj: StagedObject) -> int:
        target = objects_dir / _cache_name(root.bucket, obj.key, obj.etag)
        obj.path = str(target)
        if target.is_file() and target.stat().st_size == obj.size:
            os.utime(target)  # recency, for the cache's eviction order
            if on_bytes:
                on_bytes(obj.size)
            return 0
        return _download_verified(client, root.bucket, obj, target, on_bytes)

    with ThreadPoolExecutor(max_workers=MAX_CONCURRENT_OBJECTS) as pool:
        manifest.bytes_downloaded = sum(pool.map(fetch, manifest.objects))
    manifest.digest = _digest(root.bucket, manifest.objects)
    return manifest


def _download_verified(client, bucket: str, obj: StagedObject, target: Path, on_bytes: ProgressFn | None) -> int:
    uri = f"s3://{bucket}/{obj.key}"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    moved = 0
    for attempt in (1, 2):
        try:
            client.download_file(bucket, obj.key, str(tmp), Config=s3.TRANSFER_CONFIG, Callback=on_bytes)
        except (ClientError, BotoCoreError, S3TransferFailedError) as exc:
            tmp.unlink(missing_ok=True)
            cause = exc.__cause__ if isinstance(exc, S3TransferFailedError) and exc.__cause__ else exc
            raise s3.describe_error(cause, uri) from exc
        moved += obj.size
        problem = _verify(tmp, obj)
        if problem is None:
            os.replace(tmp, target)
            return moved
        tmp.unlink(missing_ok=True)
        if attempt == 2:
            raise DataError(f"{uri}: downloaded bytes do not match S3's record ({problem}) after a retry")
    raise AssertionError("unreachable")


def _verify(path: Path, obj: StagedObject) -> str | None:
    size = path.stat().st_size
    if size != obj.size:
        return f"size {size} != {obj.size}"
    # A multipart ETag ("<md5 of md5s>-<parts>") is not the object's MD5; size is all we can check.
    if "-" not in obj.etag and len(obj.etag) == 32:
        md5 = hashlib.md5(usedforsecurity=False)
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                md5.update(chunk)
        if md5.hexdigest() != obj.etag:
            return f"MD5 {md5.hexdigest()} != ETag {obj.etag}"
    return None


def _is_data_key(key: str) -> bool:
    # Folder markers and Spark/Hadoop side files (_SUCCESS, .crc) are not data.
    base = key.rsplit("/", 1)[-1]
    return bool(base) and not base.startswith(("_", "."))


def _check_relative_key(key: str, prefix: str, channel_uri: str) -> None:
    """Refuse keys that would escape the channel's folder if mirrored to disk."""
    rel = key[len(prefix) :] if key.startswith(prefix) else key
    parts = rel.split("/")
    if (
        "\x00" in key
        or rel.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or PurePosixPath(rel).is_absolute()
    ):
        raise DataError(
            f"s3 object {key!r} in {channel_uri} has an unsafe key (empty, '.', '..' segments, absolute path "
            "or NUL); rename it in the bucket"
        )


def _cache_name(bucket: str, key: str, etag: str) -> str:
    digest = hashlib.sha256(f"{bucket}\0{key}\0{etag}".encode()).hexdigest()
    return f"{digest[:2]}/{digest}"


def _digest(bucket: str, objects: list[StagedObject]) -> str:
    h = hashlib.sha256()
    for obj in objects:
        h.update(f"{bucket}\0{obj.key}\0{obj.size}\0{obj.etag}\n".encode())
    return "sha256:" + h.hexdigest()
