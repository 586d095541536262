"""Row groups of streamed channels kept on this machine's disk once read, as arrays: one file each
(features, then labels: two ``.npy`` records), under the cache's ``rowgroups/`` and its one size cap, shared by
every group and later job that reads the same row group the same way."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import uuid
from pathlib import Path

import numpy as np

from trainyard import cache, datasets, s3

log = logging.getLogger(__name__)

UNIT_SUFFIX = ".rowgroup.npy"


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
        os.replace(tmp, path)
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
    a probe like the staging benchmark's stream child, on the path to a group's first batch."""
    with path.open("rb") as f:
        return _map_next(f, path), _map_next(f, path)


def _map_next(f, path: Path) -> np.ndarray:
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
    array = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran_order else "C")
    f.seek(offset + array.nbytes)
    return array
