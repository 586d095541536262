"""The machine's cache under ``TRAINYARD_HOME/cache``: staged objects (``objects/``) and the row
groups streamed channels have read (``rowgroups/``, named by ``kept_rowgroups.path``).

An object's cache name is a hash of (bucket, key, ETag): the same bytes are never fetched twice,
and an object changed in place gets a new name. The cache is kept under one size cap
(``TRAINYARD_CACHE_MAX_BYTES``, default 100 GiB) by evicting the least recently used files of
either kind (by access time); a hit refreshes it, and leaves the modification time the bytes' own.

Objects a job is using are pinned (``Pin``) until it has read them: another job's eviction, in this
process or any other sharing ``TRAINYARD_HOME``, skips them even when the cache is over its cap, and
releasing the pin trims the cache back under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from trainyard.errors import TrainyardError
from trainyard.home import cache_dir, flocked

CACHE_MAX_BYTES_ENV = "TRAINYARD_CACHE_MAX_BYTES"
CACHE_VERIFY_ENV = "TRAINYARD_CACHE_VERIFY"  # on: a cached object's bytes are digested again at each hit
DEFAULT_MAX_BYTES = 100 * 2**30
PART_SUFFIX = ".part"  # a download being written, under a dot name
CLAIM_SUFFIX = ".claim"  # a part file being claimed (``claim_part``): locked, then renamed to the part's name
CLAIM_SECONDS = 60.0  # a claim older than this was left by a process killed before it renamed it
ROWGROUP_SUFFIX = ".rowgroup.npy"  # a kept row group (``kept_rowgroups``): share-locked while its arrays are mapped
META_XATTR = "user.trainyard.verified"  # on an object: what was checked when it was fetched (remember)


def objects_dir() -> Path:
    return cache_dir() / "objects"


def rowgroups_dir() -> Path:
    """Row groups of streamed channels, kept as arrays once read (``kept_rowgroups.path`` names them)."""
    return cache_dir() / "rowgroups"


def path_for(bucket: str, key: str, etag: str) -> Path:
    """Where an object version lives in the cache."""
    digest = hashlib.sha256(f"{bucket}\0{key}\0{etag}".encode()).hexdigest()
    return objects_dir() / digest[:2] / digest


def pins_dir() -> Path:
    return cache_dir() / "pins"


class Pin:
    """Cache objects a job is using: no eviction removes them while the pin is held.

    A pin is a file under ``cache/pins`` listing object paths, one a line, locked (``flock``) by its
    holder for as long as it is held. The lock dies with the process, so the pin of a job that crashed
    is found stale by the next eviction and removed. Use it as a context manager, and ``add`` paths
    before checking or reading them.
    """

    def __init__(self, trim: bool = True) -> None:
        self._trim = trim  # release trims the cache to its cap
        folder = pins_dir()
        folder.mkdir(parents=True, exist_ok=True)
        name = uuid.uuid4().hex
        # Locked under a dot name first, then renamed: an eviction never sees it unlocked (stale).
        writing = folder / f".{name}.pin.new"  # not matched by pinned()'s "*.pin"
        self._fd = os.open(writing, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.path = folder / f"{name}.pin"
        os.rename(writing, self.path)

    def add(self, paths: Iterable[str | Path]) -> None:
        """Pin ``paths``. An eviction already under way finishes first, so whatever is found in the
        cache after this returns stays there until ``release``."""
        data = memoryview("".join(f"{p}\n" for p in paths).encode())
        with _eviction_lock(fcntl.LOCK_SH):
            while data:
                data = data[os.write(self._fd, data) :]

    def release(self) -> None:
        """Unpin, then (unless made with ``trim=False``) trim the cache to its cap: the pin may have been
        all that kept it over. Trimming is housekeeping: its failure is not the caller's."""
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)  # drops the lock
        self._fd = -1
        if self._trim:
            with contextlib.suppress(OSError, TrainyardError):
                evict()

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def pinned() -> set[str]:
    """Every path pinned by a live holder; pins whose holder died are removed on the way."""
    paths: set[str] = set()
    for pin in pins_dir().glob("*.pin"):
        try:
            fd = os.open(pin, os.O_RDONLY)
        except FileNotFoundError:
            continue  # released meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (shared: _abandoned says why)
            except BlockingIOError:  # held: read what it pins (a line still being written is not whole)
                with os.fdopen(os.dup(fd), "rb") as f:
                    paths.update(line.decode() for line in f.read().split(b"\n")[:-1])
            else:  # nobody holds it: its job ended without releasing it (killed)
                pin.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return paths


@contextlib.contextmanager
def _eviction_lock(kind: int) -> Iterator[None]:
    """Shared while pins are added, exclusive while an eviction reads them and deletes."""
    with flocked(cache_dir() / "eviction.lock", kind):
        yield


def claim_part(path: Path) -> int:
    """Make the part file a download writes into, locked for as long as the returned descriptor is open
    (close it once the part is renamed or removed): an eviction then tells a live download's part from one
    a killed job left, which it removes at once (the rerun after an OOM kill needs the room)."""
    # Locked under another name first, then renamed: an eviction never sees a live part unlocked.
    claiming = path.with_name(path.name + CLAIM_SUFFIX)
    fd = os.open(claiming, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(claiming, path)
    except OSError:
        os.close(fd)
        claiming.unlink(missing_ok=True)
        raise
    return fd


@contextlib.contextmanager
def fetching(path: Path) -> Iterator[None]:
    """Held while one object is looked up and fetched into ``path``: a second staging of it (another job
    on this machine, or another thread) waits, then finds it cached, instead of downloading it again.
    One of 4,096 lock files, chosen by the object's cache name: a rare wait on another object's fetch
    costs less than a lock file left per object."""
    with flocked(cache_dir() / "fetching" / path.name[:3]):  # threads of one process wait on each other too
        yield


def _abandoned(path: Path) -> bool:
    """Whether a part file's writer is gone: nobody holds its lock (it died with its process).

    Probed with a shared lock, which the holder's exclusive one refuses as well: NFS (an EFS or ReadWriteMany
    ``TRAINYARD_HOME``) takes ``flock`` as a byte-range lock, and refuses an exclusive one on a file opened
    read-only (EBADF); such a file (a part made read-only, not yet renamed) cannot be opened for writing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remember(path: Path, record: dict) -> None:
    """Keep what was checked of a fetched object (its checksum, how it was verified) with the file, so a
    later staging that finds it cached can put the same in its manifest, and the file's modification
    time then, so that one finds whether the bytes were written since (``hit``). It is an extended
    attribute: one system call, and it goes wherever the file is renamed or linked. Where the file
    system has none, nothing is kept, and such a manifest says only that the object came from the cache."""
    record = record | {"mtime_ns": path.stat().st_mtime_ns}
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no os.setxattr (macOS)
        os.setxattr(path, META_XATTR, json.dumps(record, separators=(",", ":")).encode())


def recall(path: Path) -> dict | None:
    """What ``remember`` kept with ``path``; None when nothing was (or it cannot be read)."""
    try:
        return json.loads(os.getxattr(path, META_XATTR))
    except (OSError, AttributeError, ValueError):
        return None


def hit(path: Path, size: int) -> dict | None:
    """What ``remember`` kept of the cached object (``{}`` where nothing could be), or None when it is not
    cached whole and unchanged: only verified files get their final name, but a job's hard link to one
    (``raw_layout.mirror``) can still write to it where the read-only mode is not enforced (root), and a
    file written since it was verified is fetched again."""
    try:
        st = path.stat()
        if st.st_size != size:
            return None
        record = recall(path) or {}
        if record.get("mtime_ns", st.st_mtime_ns) != st.st_mtime_ns:
            return None
        # recency, for eviction, in the access time: the modification time stays the bytes' own
        os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
    except FileNotFoundError:
        return None  # not cached, or another job's eviction took it just now
    return record


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def max_bytes() -> int:
    """The cache's size cap: ``TRAINYARD_CACHE_MAX_BYTES`` in bytes, or with a unit (``500MB``, ``100GiB``,
    ``1T``: powers of 1000, or of 1024 with an ``i``), else 100 GiB."""
    text = os.environ.get(CACHE_MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?", text, flags=re.IGNORECASE)
    if not found:
        raise TrainyardError(
            f"{CACHE_MAX_BYTES_ENV}={text!r} is not a size; write a number of bytes, or one with a unit: "
            "500MB, 100GiB, 2T"
        )
    return int(float(found[1]) * _UNITS[(found[2] or "").lower()])


def evict(limit: int | None = None, keep: Iterable[str] = ()) -> dict:
    """Delete the least recently used objects and kept row groups until the cache fits ``limit`` (one cap for
    both); never the objects a job has pinned, nor the files in ``keep``.

    Nor a row group whose arrays a job has mapped (``kept_rowgroups.load`` share-locks it while they live): on a
    local file system a mapping outlives its file, but where the cache is an NFS volume that several nodes share
    (EFS, a ReadWriteMany volume), a file unlinked on one node is freed under another's mapping, and that process
    dies of SIGBUS at its next read of it."""
    with _eviction_lock(fcntl.LOCK_EX):
        files = itertools.chain(objects_dir().glob("*/*"), rowgroups_dir().glob("*"))
        return evict_files(files, pinned() | set(keep), limit)


def evict_files(paths: Iterable[Path], keep: set[str], limit: int | None = None) -> dict:
    """Delete the least recently used of ``paths`` until they fit ``limit`` (``TRAINYARD_CACHE_MAX_BYTES``);
    never those in ``keep``, nor names starting with a dot (being written), nor kept row groups in use."""
    limit = max_bytes() if limit is None else limit
    entries, writing = [], 0
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # another job's eviction took it meanwhile
        if path.name.startswith("."):  # a download in progress (its room counted); one left by a killed job goes
            if path.name.endswith(PART_SUFFIX) and _abandoned(path):
                path.unlink(missing_ok=True)
            elif path.name.endswith(CLAIM_SUFFIX) and time.time() - st.st_mtime > CLAIM_SECONDS and _abandoned(path):
                # a part's claim is locked and renamed microseconds after it is made (``claim_part``): one this old
                # and unlocked was left by a process killed in between (the age: the file server's clock may not be
                # this machine's), and no eviction removed it
                path.unlink(missing_ok=True)
            else:
                writing += st.st_size
            continue
        entries.append((st.st_atime, st.st_size, st.st_nlink, path))  # last used (``hit``, or read) first
    total = writing + sum(size for _, size, _, _ in entries)
    evicted, freed = 0, 0
    for _, size, links, path in sorted(entries):
        if total - freed <= limit:
            break
        if str(path) in keep or links > 1:
            # linked into a job's folder (a raw channel's mirror): unlinking it here frees no disk until that job
            # is cleaned up, and the next job would fetch a second copy; it goes once it is the cache's alone
            continue
        if path.name.endswith(ROWGROUP_SUFFIX):
            if not unlink_unmapped(path):
                continue  # in use: it frees nothing
        else:
            path.unlink(missing_ok=True)
        evicted += 1
        freed += size
    return {"cache_bytes": total - freed, "evicted_objects": evicted, "evicted_bytes": freed}


def unlink_unmapped(path: Path) -> bool:
    """Unlink a kept row group unless some process has its arrays mapped, which holds a shared lock on it
    (``kept_rowgroups.load``); whether it went. Unlinked under an exclusive lock: a load that opened the file
    meanwhile cannot lock it before it is gone, then finds the name no longer its file, and reads it again.

    Opened for writing: NFS takes ``flock`` as a byte-range lock, and refuses an exclusive one on a file opened
    read-only (EBADF, as ``_abandoned`` says). Another user's, which this one may not write, is probed read-only:
    on NFS it is then left, as whether it is in use cannot be told there."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True  # removed meanwhile (a load found it damaged): its room is free all the same
    except PermissionError:  # another user's (pods of other users on a shared volume): probed read-only, which a
        try:  # local file system's flock takes; NFS's refuses (EBADF, below), and the file is left
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: a process has its arrays mapped
            return False
        try:
            # a save may have put a new copy under the name since it was opened, which a load may have mapped
            if not os.path.samestat(os.fstat(fd), os.stat(path)):
                return False
            path.unlink()
        except FileNotFoundError:
            pass  # removed meanwhile
        except PermissionError:  # another user's in a sticky folder: left, as before
            return False
        return True
    finally:
        os.close(fd)  # the lock goes with it
