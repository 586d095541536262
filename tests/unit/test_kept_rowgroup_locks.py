"""Kept row groups in use are not evicted: a group that has a row group's arrays mapped holds a shared lock on its
file until they are collected, and eviction passes over a file it cannot lock exclusively. On an NFS cache that
several nodes share (EFS, a ReadWriteMany volume), a file unlinked on one node is freed under another's mapping,
and that process died of SIGBUS. A load that meets an eviction takes the row group for missing (read again)."""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import s3_endpoints
from tests.conftest import blobs_table
from tests.nfs_locks import nfs_flock
from tests.unit.streams import stream_one_object
from trainyard import cache, kept_rowgroups, streaming

s3_endpoint = s3_endpoints.s3_endpoint

# another node's training group: maps a kept row group's arrays and trains on them until told to drop them
MAP_AND_HOLD = """
import gc, sys
from pathlib import Path
from trainyard import kept_rowgroups
x, y = kept_rowgroups.load(Path(sys.argv[1]))
print("mapped", flush=True)
sys.stdin.readline()
del x, y
gc.collect()
print("dropped", flush=True)
sys.stdin.readline()
print(Path(sys.argv[1]).exists(), flush=True)
"""


def keep(name: str, rows: int = 4) -> Path:
    path = cache.rowgroups_dir() / f"{name}{kept_rowgroups.UNIT_SUFFIX}"
    assert kept_rowgroups.save(path, np.ones((rows, 3), np.float32), np.arange(rows))
    return path


def test_a_row_group_another_process_has_mapped_is_not_evicted_until_it_drops_the_arrays(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(fcntl, "flock", nfs_flock(fcntl.flock))
    used, unused = keep("used"), keep("unused")
    node_b = subprocess.Popen(
        [sys.executable, "-c", MAP_AND_HOLD, str(used)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert node_b.stdout.readline() == b"mapped\n"
        evicted = cache.evict(limit=0)  # over the cap: everything that can go, goes
        assert used.exists(), "evicted under another process's mapping"
        assert not unused.exists() and evicted["evicted_objects"] == 1
        assert evicted["cache_bytes"] == used.stat().st_size  # what stays is not counted as freed
        node_b.stdin.write(b"drop\n")
        node_b.stdin.flush()
        assert node_b.stdout.readline() == b"dropped\n"
        assert cache.evict(limit=0)["evicted_objects"] == 1 and not used.exists()  # its arrays gone, it goes
        node_b.stdin.write(b"check\n")
        node_b.stdin.flush()
        assert node_b.stdout.readline() == b"False\n"  # (it went while that process still ran)
    finally:
        node_b.kill()
        node_b.wait()


def test_the_file_stays_while_either_array_or_a_view_of_one_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    path = keep("unit", rows=1000)
    x, y = kept_rowgroups.load(path)
    view = x[10:20]  # a part of the row group, as a group covering several slots takes one
    del x
    gc.collect()
    assert cache.evict(limit=0)["evicted_objects"] == 0 and path.exists()
    del view
    gc.collect()
    assert cache.evict(limit=0)["evicted_objects"] == 0 and path.exists()  # the labels are still mapped
    assert y.tolist() == list(range(1000))
    del y
    gc.collect()
    assert cache.evict(limit=0)["evicted_objects"] == 1 and not path.exists()


def test_a_row_group_an_eviction_is_removing_is_missing_to_a_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    path = keep("unit")
    evictor = os.open(path, os.O_RDWR)  # another node's eviction, between its lock and its unlink
    try:
        fcntl.flock(evictor, fcntl.LOCK_EX)
        with pytest.raises(FileNotFoundError):
            kept_rowgroups.load(path)
    finally:
        os.close(evictor)
    assert kept_rowgroups.load(path)[1].tolist() == [0, 1, 2, 3]  # once it is let go


def test_a_row_group_kept_again_leaves_the_copy_a_group_has_mapped_in_place(tmp_path, monkeypatch):
    # staging the same channel again (another job), or two groups missing it at once: the second save renamed its
    # copy over the first, which a group on another node had mapped (SIGBUS on NFS, as an eviction's unlink)
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    path = keep("unit")
    x, y = kept_rowgroups.load(path)
    before = os.stat(path)
    assert kept_rowgroups.save(path, np.zeros((4, 3), np.float32), np.arange(4))
    assert os.path.samestat(os.stat(path), before) and os.stat(path).st_nlink == 1
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # its part file gone
    assert x.tolist() == np.ones((4, 3)).tolist()


@pytest.mark.parametrize("meanwhile", ["evicted", "replaced"])
def test_a_row_group_evicted_or_replaced_between_the_open_and_the_lock_is_missing_to_a_load(
    tmp_path, monkeypatch, meanwhile
):
    # the load's lock came after the eviction's unlink: it held a lock on a file no longer in the cache, which
    # the next eviction could not see to spare, nor a later load find
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    path = keep("unit")
    real = fcntl.flock

    def late_lock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_SH:
            if meanwhile == "evicted":
                assert cache.evict(limit=0)["evicted_objects"] == 1
            else:  # renamed over it (a save on a file system without hard links, where none was kept yet)
                os.replace(keep("copy"), path)
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", late_lock)
    with pytest.raises(FileNotFoundError):
        kept_rowgroups.load(path)


def test_a_group_whose_row_group_is_being_evicted_reads_it_from_s3_again(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    table = blobs_table(200, seed=11)
    bucket, _, staged = stream_one_object(s3_endpoint, tmp_path, table, 100)
    source = streaming.RowGroupSource(staged.train_layout, staged.schema, cache.rowgroups_dir())
    unit = f"s3://{bucket}/t/a.parquet#rg1"
    source.load(unit)
    (kept,) = cache.rowgroups_dir().glob(f"*{kept_rowgroups.UNIT_SUFFIX}")
    reads = []
    real_read = streaming._read_row_group
    monkeypatch.setattr(streaming, "_read_row_group", lambda pf, i, *a: reads.append(i) or real_read(pf, i, *a))
    evictor = os.open(kept, os.O_RDWR)
    try:
        fcntl.flock(evictor, fcntl.LOCK_EX)
        _, y = source.load(unit)
    finally:
        os.close(evictor)
    assert reads == [1]  # read again, not mapped from a file on its way out
    np.testing.assert_array_equal(y, table["label"].to_numpy()[100:])


def test_a_row_group_this_user_may_not_remove_is_left_and_eviction_goes_on(tmp_path, monkeypatch):
    # another user's, in a shared sticky folder: its unlink refused; eviction raised, and the group evicting failed
    from pathlib import Path

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    theirs, ours = keep("theirs"), keep("ours")
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self == theirs:
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    done = cache.evict(limit=0)
    assert theirs.exists() and not ours.exists() and done["evicted_objects"] == 1
