"""Stage 1, staging: fetch and verify a channel's objects (as ``listing`` found them) from S3 into a
content-addressed cache.

Each object is cached under a name derived from (bucket, key, ETag), so an unchanged object is
never fetched twice and an object changed in place is fetched again. An object whose version the
channel's manifest pins is fetched at that version; its ETag, which names its content, keys it in
the cache. A download lands under a
temporary name and is renamed only once it matches what S3 says of it (``integrity``); a mismatch
is fetched once more, then fails naming the object. The channel's manifest (objects, sizes,
checksums, and a digest of it all) is the data lineage later stages record.

Small objects are fetched with one conditional GET each (``If-Match`` the listed ETag, so an
object replaced mid-staging is caught), many at a time; large ones one at a time through boto3's
transfer manager (ranged, concurrent parts).
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded
from s3transfer.exceptions import S3DownloadFailedError

from trainyard import cache, env_settings, integrity, listing, parallel, progress, s3
from trainyard.errors import DataError, StorageError
from trainyard.home import write_json_atomic
from trainyard.listing import ChannelManifest, StagedObject, list_channel
from trainyard.spec import Channel

# A GET whose body breaks off mid-stream is not retried by botocore; these attempts cover it.
STREAM_ATTEMPTS = 3
ProgressFn = Callable[[int], None]
# HEADs of parts (_part_sizes) in flight at once, over all objects: up to listing.MAX_CONCURRENT_OBJECTS
# small objects are fetched at once, each needing its part sizes when the endpoint lists no parts, and the
# GETs and these HEADs share the client's 32 connections (s3.py). Bounded per object only, 16 objects of 4
# parts HEADed up to 64 at once: urllib3 opened a connection past the pool for each, and discarded it with a
# "Connection pool is full" warning (36 in flight through a proxy, against moto).
PART_HEADS_AT_ONCE = 8
_part_heads = threading.BoundedSemaphore(PART_HEADS_AT_ONCE)


def stage_channels(
    channels: dict[str, Channel], manifest_dir: Path, pin: cache.Pin | None = None
) -> dict[str, ChannelManifest]:
    """Stage every channel with a progress bar; write each manifest to ``manifest_dir/<name>.json``.

    The objects are pinned in the cache by ``pin``, which the caller releases once it has read them
    (without one, they are pinned only while this runs). Afterwards the cache is trimmed to its size
    cap, least recently used first, never evicting an object any job has pinned; releasing the
    caller's pin trims it again.
    A ``mode: stream`` channel is listed only: its replica groups read it from S3 themselves.
    """
    cache.max_bytes()  # a malformed cap fails here, before anything is fetched
    env_settings.flag(cache.CACHE_VERIFY_ENV)  # as does a malformed switch
    with contextlib.ExitStack() as stack:
        # Our own pin is released without a trim: it would take what was just staged, were the channel
        # over the cap; the trim below, while it holds, never does.
        pin = pin or stack.enter_context(cache.Pin(trim=False))
        manifests = {}
        for name, channel in channels.items():
            manifest = list_channel(name, channel)
            if channel.mode == "stream":
                for obj in manifest.objects:
                    if obj.version_id:
                        raise DataError(
                            f"{obj.uri}: mode stream reads the latest version of each object (pyarrow cannot "
                            "read another); stage a manifest that pins versions with mode file"
                        )
                    obj.verified_by = "streamed"
                manifests[name] = manifest
            else:
                with progress.transfer(f"staging {name}", manifest.bytes, len(manifest.objects)) as (moved, done):
                    manifests[name] = fetch_channel(manifest, moved, pin, done)
            write_json_atomic(manifest_dir / f"{name}.json", manifests[name].to_dict())
        cache.evict()  # never an object pinned; a caller's pin trims again when released
    return manifests


def fetch_channel(
    manifest: ChannelManifest,
    on_bytes: ProgressFn | None = None,
    pin: cache.Pin | None = None,
    on_objects: Callable[[int], None] | None = None,
) -> ChannelManifest:
    """Fetch every listed object into the cache, verified; fill in paths, bytes moved and the digest.

    ``on_bytes`` is called with each chunk of bytes transferred and ``on_objects`` with each count of
    objects done (for a progress bar). ``pin`` keeps the objects from eviction by other jobs from before they are
    looked up in the cache.
    """
    on_objects = on_objects or (lambda n: None)
    client = s3.client()
    for obj in manifest.objects:
        obj.path = str(cache.path_for(obj.bucket, obj.key, obj.etag))
    if pin is not None:
        pin.add(obj.path for obj in manifest.objects)
    small: list[StagedObject] = []
    large: list[StagedObject] = []
    for obj in manifest.objects:
        if _cached(obj, on_bytes, manifest):
            continue
        (large if obj.size >= s3.TRANSFER_CONFIG.multipart_threshold else small).append(obj)
    on_objects(len(manifest.objects) - len(small) - len(large))  # the cached ones
    if pin is not None and (needed := sum(obj.size for obj in small + large)):
        # Room made before fetching, not only after: a cache at its cap on a disk that holds little more
        # would fail every rerun for want of the room the trim after it frees. The hits are pinned.
        cache.evict(limit=max(0, cache.max_bytes() - needed))

    def fetch(obj: StagedObject, getter) -> int | None:
        """Bytes moved fetching ``obj``; None if another staging of it (a job beside this one) just did."""
        with cache.fetching(Path(obj.path)):
            transferred = None if _cached(obj, on_bytes, manifest) else _fetch_verified(client, obj, on_bytes, getter)
        on_objects(1)
        return transferred

    moved = parallel.map_in_threads(lambda o: fetch(o, _get_small), small, listing.MAX_CONCURRENT_OBJECTS)
    # Large objects one at a time: the transfer manager already fetches each in concurrent parts.
    moved += [fetch(o, _get_large) for o in large]
    manifest.bytes_downloaded = sum(n for n in moved if n is not None)
    manifest.objects_downloaded = sum(1 for n in moved if n is not None)
    return manifest


def _cached(obj: StagedObject, on_bytes: ProgressFn | None, manifest: ChannelManifest) -> bool:
    """Whether ``obj`` is in the cache, whole and unchanged; if so its manifest entry says how it was verified
    when it was fetched, and with which checksum. With ``TRAINYARD_CACHE_VERIFY`` on, its bytes are digested
    again against that checksum: one that no longer matches (a disk's bit flip keeps the size and the
    modification time) is fetched again, and named in the manifest's ``cache_mismatches``; one kept with no
    checksum to check against is fetched again too, and named in ``cache_unverifiable``."""
    known = cache.hit(Path(obj.path), obj.size)
    if known is None:
        return False
    checked = None
    if env_settings.flag(cache.CACHE_VERIFY_ENV):
        if "etag" not in known:  # cached by an older Trainyard, or where no extended attribute is kept
            if obj.uri not in manifest.cache_unverifiable:
                manifest.cache_unverifiable.append(obj.uri)
            return False
        problem, checked = _verify_again(Path(obj.path), obj.size, known)
        if problem is None and checked == "size":  # kept with nothing but its size (by an older Trainyard)
            if obj.uri not in manifest.cache_unverifiable:
                manifest.cache_unverifiable.append(obj.uri)
            return False
        if problem is not None:
            if obj.uri not in manifest.cache_mismatches:
                manifest.cache_mismatches.append(obj.uri)
            return False
    obj.checksum = obj.checksum or known.get("checksum")
    if checked is not None:
        obj.verified_by = f"cache, verified again ({checked})"
    elif not obj.verified_by:
        obj.verified_by = f"cache ({known['verified_by']})" if known.get("verified_by") else "cache"
    if on_bytes:
        on_bytes(obj.size)
    return True


def _verify_again(path: Path, size: int, known: dict) -> tuple[str | None, str]:
    """A cached file's bytes against what was checked when it was fetched: ``(problem or None, checked)``."""
    parts = [part for part, count in known.get("parts") or [] for _ in range(count)] or None
    return _digest_file(path, known["etag"], known.get("checksum"), parts, known.get("local")).result(size)


def _runs(sizes: list[int] | None) -> list[list[int]] | None:
    """Part sizes as ``[size, count]`` runs: a multipart object's parts are of one size but the last, and an
    extended attribute holds a few KB (ext4's limit, ~450 parts listed one by one, a 4 GB object's)."""
    runs: list[list[int]] = []
    for size in sizes or []:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return runs or None


def fetch_object(uri: str, target: Path) -> StagedObject:
    """One object outside any channel (a checkpoint) fetched to ``target`` as channel objects are:
    under a temporary name, checked against S3's record (size and a checksum), renamed once whole."""
    client = s3.client()
    try:
        obj = listing.head(client, s3.S3Uri.parse(uri))
    except BotoCoreError as exc:
        raise s3.describe_error(exc, uri) from exc
    obj.path = str(target)
    large = obj.size >= s3.TRANSFER_CONFIG.multipart_threshold
    _fetch_verified(client, obj, None, _get_large if large else _get_small)
    return obj


def _fetch_verified(client, obj: StagedObject, on_bytes: ProgressFn | None, getter) -> int:
    """Fetch with ``getter`` to a temporary name, verify, rename; one more try on a mismatch."""
    target = Path(obj.path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Unique per call: two stagings of one object in one process must not write into each other's file.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{cache.PART_SUFFIX}")
    moved = 0
    try:
        claim = cache.claim_part(tmp)
    except OSError as exc:
        if s3.disk_full(exc):
            raise s3.describe_error(exc, obj.uri) from exc
        raise
    try:
        for attempt in (1, 2):
            shown: list[int] = []  # what the progress bar was told
            told = _telling(on_bytes, shown) if on_bytes else None
            digester = getter(client, obj, tmp, told)  # digests the bytes as they arrive
            moved += obj.size
            problem, obj.verified_by = digester.result(obj.size)
            obj.checksum = digester.checksum
            if problem is None:
                # and what checking the bytes again takes (TRAINYARD_CACHE_VERIFY)
                kept = {"etag": digester.etag, "parts": _runs(digester.part_sizes), "local": digester.local_checksum}
                cache.remember(tmp, {"checksum": obj.checksum, "verified_by": obj.verified_by} | kept)
                # Read-only: a job's hard-linked copy (mirror) shares this file, and must not change the cache's.
                tmp.chmod(0o444)
                os.replace(tmp, target)
                return moved
            if attempt == 2:
                raise DataError(f"{obj.uri}: downloaded bytes do not match S3's record ({problem}) after a retry")
            if on_bytes:
                on_bytes(-sum(shown))  # fetched again: the bar counts the object's bytes once
    finally:
        tmp.unlink(missing_ok=True)
        os.close(claim)
    raise AssertionError("unreachable")


def _telling(on_bytes: ProgressFn, shown: list[int]) -> ProgressFn:
    """``on_bytes``, noting each count in ``shown`` too (append: safe from the transfer threads)."""

    def told(n: int) -> None:
        shown.append(n)
        on_bytes(n)

    return told


def _get_small(client, obj: StagedObject, tmp: Path, on_bytes: ProgressFn | None) -> integrity.Digester:
    """One conditional GET, streamed to ``tmp`` and digested against the record S3 sent with it."""
    for attempt in range(1, STREAM_ATTEMPTS + 1):
        written = 0
        try:
            response = client.get_object(
                Bucket=obj.bucket, Key=obj.key, IfMatch=f'"{obj.etag}"', ChecksumMode="ENABLED", **obj.version
            )
            # An endpoint that ignores If-Match (rclone does) sends whatever is there now; its own
            # checksum would pass, and the new bytes would be cached under the old ETag.
            if wrong := _not_as_listed(obj, response):
                response["Body"].close()
                raise wrong
            etag, checksum = integrity.md5_etag(obj.etag, response), integrity.checksum_of(response)
            digester = integrity.Digester(etag, checksum)
            with tmp.open("wb") as f:
                try:
                    for chunk in response["Body"].iter_chunks(1 << 20):
                        digester.update(chunk)
                        f.write(chunk)
                        written += len(chunk)
                        if on_bytes:
                            on_bytes(len(chunk))
                except FlexibleChecksumError:
                    pass  # botocore's own check, at the end of the body; the digester says what differs
            if checksum and checksum["type"] == "COMPOSITE" and digester.hasher is None:
                # A small multipart object (8 MiB parts of a 10 MiB file, say): its composite checksum is
                # checked against the file once its part sizes are known, as a large object's is.
                parts = _part_sizes(client, obj)
                if parts:
                    digester = _digest_file(tmp, etag, checksum, parts)
            return digester
        except StorageError:
            raise  # already says what happened (an OSError, which the body's breaking off below is too)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
                raise _changed(obj) from exc
            raise _deleted(obj, exc) or s3.describe_error(exc, obj.uri) from exc
        except (BotoCoreError, OSError) as exc:
            # The body broke off (a dropped connection):
            # take back the progress and try again, a bounded number of times.
            if on_bytes and written:
                on_bytes(-written)
            if attempt == STREAM_ATTEMPTS or s3.disk_full(exc):
                raise s3.describe_error(exc, obj.uri) from exc
    raise AssertionError("unreachable")


def _get_large(client, obj: StagedObject, tmp: Path, on_bytes: ProgressFn | None) -> integrity.Digester:
    """The transfer manager's ranged, concurrent download, digested while the parts land; the
    checksum (and, for a composite one, the part sizes it needs) come from a HEAD first."""
    try:
        head = client.head_object(Bucket=obj.bucket, Key=obj.key, ChecksumMode="ENABLED", **obj.version)
        if wrong := _not_as_listed(obj, head):
            raise wrong
        checksum = integrity.checksum_of(head)
        parts = _part_sizes(client, obj) if checksum and checksum["type"] == "COMPOSITE" else None
        etag = integrity.md5_etag(obj.etag, head)
        digester = integrity.Digester(etag, checksum, parts)
        target = integrity.FollowingDigest(tmp, digester.update)
        try:
            client.download_fileobj(
                obj.bucket, obj.key, target, ExtraArgs=obj.version or None, Config=s3.TRANSFER_CONFIG, Callback=on_bytes
            )
        finally:
            target.close()
        # The transfer manager's ranged GETs carry If-Match with the ETag of its own first look, which may
        # already be the replacement's (replaced between our HEAD and its): asked again, S3 says whether
        # what was downloaded is what was listed.
        if wrong := _not_as_listed(obj, client.head_object(Bucket=obj.bucket, Key=obj.key, **obj.version)):
            raise wrong
    except S3DownloadFailedError as exc:  # a ranged GET's If-Match failed: replaced during the download
        raise _changed(obj) from exc
    except (ClientError, BotoCoreError, Boto3Error, TransferRetriesExceeded, OSError) as exc:
        # botocore's timeouts are OSErrors too, as are a dropped connection's and a full disk's
        network = isinstance(exc, BotoCoreError | ConnectionError | TimeoutError)
        # ours already (StorageError), or a bug, with its traceback; the part file's disk failing (EIO, a read-only
        # or unwritable folder: an errno) is named for the object below, as a small object's is
        local = isinstance(exc, OSError) and not network and not s3.disk_full(exc)
        if local and (isinstance(exc, StorageError) or exc.errno is None):
            raise
        # boto3 and s3transfer wrap the last error of a failed transfer (S3TransferFailedError's cause,
        # RetriesExceededError's last_exception): describe that one, naming the object.
        wrapped = isinstance(exc, Boto3Error | TransferRetriesExceeded)
        cause = (getattr(exc, "last_exception", None) or exc.__cause__) if wrapped else None
        raise _deleted(obj, cause or exc) or s3.describe_error(cause or exc, obj.uri) from exc
    if target.rewritten:  # a retried part: what was digested on the way may not be what is on disk
        digester = _digest_file(tmp, etag, checksum, parts)
    return digester


def _not_as_listed(obj: StagedObject, response: dict) -> StorageError | None:
    """The error when a GET or HEAD answered for something other than what was listed: another ETag
    (replaced since; quoted, as S3 sends it), or another version than the one pinned."""
    if response["ETag"].strip('"') != obj.etag:
        return _changed(obj)
    return listing.wrong_version(obj, response)


def _changed(obj: StagedObject) -> StorageError:
    return StorageError(f"{obj.uri}: changed in S3 while it was being staged; run the job again", transient=True)


def _deleted(obj: StagedObject, exc: BaseException) -> StorageError | None:
    """The error for a listed object S3 no longer has (deleted since the listing), else None. Transient, as a
    replaced one is: the stage's retry lists the channel again. Not for a pinned version, whose absence is
    the manifest's to fix."""
    code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
    if code in ("NoSuchKey", "404", "NotFound") and not obj.version:
        return StorageError(f"{obj.uri}: deleted from S3 while it was being staged; run the job again", transient=True)
    return None


def _digest_file(
    path: Path, etag: str, checksum: dict | None, parts: list[int] | None, local: str | None = None
) -> integrity.Digester:
    """A file's digest, read back from disk, against S3's record of the object (or ``local``, its bytes' own
    checksum as first fetched, where S3 gave nothing but the size)."""
    digester = integrity.Digester(etag, checksum, parts, local)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(4 << 20), b""):
            digester.update(chunk)
    return digester


def _part_sizes(client, obj: StagedObject) -> list[int] | None:
    """The sizes of a multipart object's parts (GetObjectAttributes, else a HEAD per part)."""
    count = int(obj.etag.rsplit("-", 1)[1]) if "-" in obj.etag else 0
    if not count:
        return None
    parts: list[dict] = []
    marker: dict[str, int] = {}
    with contextlib.suppress(ClientError):  # refused (a read-only role of GetObject and ListBucket; R2): the HEADs
        while True:  # S3 lists at most 1,000 parts an answer; an object may have 10,000
            attrs = client.get_object_attributes(
                Bucket=obj.bucket, Key=obj.key, ObjectAttributes=["ObjectParts"], MaxParts=1000, **marker, **obj.version
            )
            listed = attrs.get("ObjectParts", {})
            parts += listed.get("Parts") or []
            if not listed.get("IsTruncated") or not listed.get("NextPartNumberMarker") or len(parts) >= count:
                break
            marker = {"PartNumberMarker": listed["NextPartNumberMarker"]}
    if len(parts) == count:
        return [p["Size"] for p in sorted(parts, key=lambda p: p["PartNumber"])]

    def head(number: int) -> dict:
        with _part_heads:
            return client.head_object(Bucket=obj.bucket, Key=obj.key, PartNumber=number, **obj.version)

    try:
        with ThreadPoolExecutor(max_workers=min(count, PART_HEADS_AT_ONCE)) as pool:
            return [h["ContentLength"] for h in pool.map(head, range(1, count + 1))]
    except ClientError:
        return None  # the endpoint cannot say: the size alone is checked
