"""Row groups of streamed channels kept on this machine's disk once read, as arrays: one file each
(features, then labels: two ``.npy`` records), under the cache's ``rowgroups/`` and its one size cap, shared by
every group and later job that reads the same row group the same way."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import uuid
import weakref
from pathlib import Path

import numpy as np

from trainyard import cache, datasets, s3

log = logging.getLogger(__name__)

UNIT_SUFFIX = cache.ROWGROUP_SUFFIX  # eviction tells kept row groups by it


def path(cache_dir: Path, unit_id: str, etag: str, schema: datasets.Schema) -> Path:
    """Where a row group's arrays are kept once read: named by a hash of the row group, its object's ETag
    and the schema that made the arrays (features, label, task, classes), so that no two objects (``a/b`` and
    ``a_b``) share a file, a changed object is read again, jobs that read the same row group the same way
    share it, and a long key still makes a short name."""
    made_by = json.dumps([schema.features, schema.label, schema.task, schema.classes], default=str)
    digest = hashlib.sha256(f"{unit_id}\0{etag}\0{made_by}".encode()).hexdigest()[:32]
    return cache_dir / f"{digest}-rg{unit_id.rpartition('#rg')[2]}{UNIT_SUFFIX}"


def save(path: Path, x: np.ndarray, y: np.ndarray) -> bool:
    """Keep a row group's arrays at ``path``; False, with nothing left behind, when the disk is full.

    Keeping one only spares a later read from S3, so a full disk costs that read, not the job: the
    cache is trimmed to its cap (which may be set above what the disk holds) and training goes on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a part file, claimed (locked) as a download's: eviction passes over it while this writes, and removes it
    # once its writer is gone (killed); unique, as groups on one machine (or pods sharing one file system) may
    # race to write the same row group
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{cache.PART_SUFFIX}")
    fd = None
    try:
        fd = cache.claim_part(tmp)
        with open(fd, "wb", closefd=False) as f:
            np.lib.format.write_array(f, x, allow_pickle=False)
            np.lib.format.write_array(f, y, allow_pickle=False)
        # linked, not renamed over: a copy kept already (another group's, another job's staging of the same
        # channel) may be mapped by a group on another node, which its replacement would kill (SIGBUS on NFS, as
        # an eviction would: see ``load``). Its name then changes only by an eviction that holds its lock.
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # kept already: the same arrays (named by the row group, its ETag and the schema)
        except OSError as exc:
            if s3.disk_full(exc):
                raise
            if not path.exists():  # a file system without hard links (EPERM, ENOTSUP, ENOSYS): renamed into place
                os.replace(tmp, path)
        tmp.unlink(missing_ok=True)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if not s3.disk_full(exc):
            raise
        log.warning("row group not kept, the disk is full (%s): it will be read from S3 again when needed", exc)
        cache.evict()
        return False
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with it, once the part is renamed or removed
    return True


def load(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A kept row group's arrays, mapped read-only from the file, not read into memory: batches touch
    only the pages of the rows they gather, and the page cache holds one copy for every group of the
    machine. Reading copied the whole row group first: 18 MB took 3 ms, and 17-35 ms in 3 of 5 runs of
    a probe like the staging benchmark's stream child, on the path to a group's first batch.

    The file is share-locked (``flock``) for as long as either array (or a view of it) is alive, and eviction
    passes over a file it cannot lock exclusively (``cache.evict_files``): where the cache is an NFS volume that
    pods of several nodes share, a file unlinked on one node is freed under another's mapping (NFS keeps a
    removed file open only for its own client), and that process dies of SIGBUS at its next read of it. A file an
    eviction is removing right now is missing (``FileNotFoundError``): the caller reads the row group again."""
    fd = os.open(path, os.O_RDONLY)  # (a shared lock is a read lock on NFS: a read-only file takes it)
    held = _Held(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileNotFoundError(errno.ENOENT, "being evicted", str(path)) from None
        if not os.path.samestat(os.fstat(fd), os.stat(path)):  # unlinked (or replaced) between the open and the lock
            raise FileNotFoundError(errno.ENOENT, "evicted while opened", str(path))
        with open(fd, "rb", closefd=False) as f:
            return _map_next(f, held), _map_next(f, held)
    except BaseException:
        held.release()
        raise


class _Held:
    """A kept row group's file, open and share-locked until every mapping of it is gone (``load``)."""

    def __init__(self, fd: int) -> None:
        self.release = weakref.finalize(self, os.close, fd)  # the lock goes with the descriptor

    def outlive(self, mapping: mmap.mmap) -> None:
        """Stay open at least as long as ``mapping``: both arrays' mappings hold it, through their finalizers'
        arguments, so the file closes once the last of them is collected, whichever that is."""
        weakref.finalize(mapping, _nothing, self).atexit = False


def _nothing(*_) -> None:
    """What a mapping's finalizer calls: it is there only to hold its arguments (``_Held.outlive``)."""


def _map_next(f, held: _Held) -> np.ndarray:
    """Map the ``.npy`` record at ``f``'s position and move past it."""
    version = np.lib.format.read_magic(f)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in read_header:  # a format save does not write
        f.seek(-np.lib.format.MAGIC_LEN, os.SEEK_CUR)
        return np.lib.format.read_array(f, allow_pickle=False)
    shape, fortran_order, dtype = read_header[version](f)
    offset = f.tell()
    if math.prod(shape) == 0:  # nothing to map (mmap refuses a length of 0)
        return np.empty(shape, dtype=dtype)
    # mapped from the locked descriptor, not opened again by name: the name may be another file's by now
    array = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran_order else "C")
    held.outlive(array._mmap)  # type: ignore[attr-defined]  # (what owns the mapping: views of the array hold it)
    f.seek(offset + array.nbytes)
    return array
