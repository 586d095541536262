"""The content-addressed object cache under ``TRAINYARD_HOME/cache/objects``.

An object's cache name is a hash of (bucket, key, ETag): the same bytes are never fetched twice,
and an object changed in place gets a new name. The cache is kept under a size cap
(``TRAINYARD_CACHE_MAX_BYTES``, default 100 GiB) by evicting the least recently used objects; a
hit refreshes an object's time.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from trainyard.home import cache_dir

CACHE_MAX_BYTES_ENV = "TRAINYARD_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 100 * 2**30


def objects_dir() -> Path:
    return cache_dir() / "objects"


def path_for(bucket: str, key: str, etag: str) -> Path:
    """Where an object version lives in the cache."""
    digest = hashlib.sha256(f"{bucket}\0{key}\0{etag}".encode()).hexdigest()
    return objects_dir() / digest[:2] / digest


def hit(path: Path, size: int) -> bool:
    """Whether the object is cached (complete: only verified files ever get their final name)."""
    try:
        if path.stat().st_size != size:
            return False
        os.utime(path)  # recency, for eviction
    except FileNotFoundError:
        return False  # not cached, or another job's eviction took it just now
    return True


def max_bytes() -> int:
    return int(os.environ.get(CACHE_MAX_BYTES_ENV) or DEFAULT_MAX_BYTES)


def evict(keep: set[str], limit: int | None = None) -> dict:
    """Delete least recently used objects until the cache fits ``limit``; never those in ``keep``."""
    return evict_files(objects_dir().glob("*/*"), keep, limit)


def evict_files(paths: Iterable[Path], keep: set[str], limit: int | None = None) -> dict:
    """Delete the least recently used of ``paths`` until they fit ``limit`` (``TRAINYARD_CACHE_MAX_BYTES``);
    never those in ``keep``, nor names starting with a dot (being written)."""
    limit = max_bytes() if limit is None else limit
    entries = []
    for path in paths:
        if path.name.startswith("."):
            continue  # a download in progress
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # another job's eviction took it meanwhile
        entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    evicted, freed = 0, 0
    for _, size, path in sorted(entries):
        if total - freed <= limit:
            break
        if str(path) in keep:
            continue
        path.unlink(missing_ok=True)
        evicted += 1
        freed += size
    return {"cache_bytes": total - freed, "evicted_objects": evicted, "evicted_bytes": freed}
