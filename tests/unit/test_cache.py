"""The machine's cache under TRAINYARD_HOME: read-only verified files, a cached file written since it was
verified fetched again, the size cap and least-recently-used eviction, and pins that keep a job's objects
from other jobs' eviction (against both S3 endpoints where staging is involved)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests import s3_endpoints
from tests.unit.objects import put_big, stage
from trainyard import cache, listing, raw_layout, staging
from trainyard.errors import TrainyardError
from trainyard.spec import Channel

s3_endpoint = s3_endpoints.s3_endpoint


def test_a_cached_object_is_read_only(s3_endpoint, tmp_path):
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"x" * 100)
    path = Path(stage(f"s3://{bucket}/ch/", tmp_path, format="raw").objects[0].path)
    assert path.stat().st_mode & 0o777 == 0o444  # a job's hard-linked copy cannot change the cache's bytes


def test_cache_evicts_least_recently_used_but_never_the_current_channel(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))  # a cache of this test's objects only
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for i in range(3):
        client.put_object(Bucket=bucket, Key=f"old{i}/x.bin", Body=bytes(1000))
        stage(f"s3://{bucket}/old{i}/", tmp_path, format="raw")
    client.put_object(Bucket=bucket, Key="new/x.bin", Body=bytes(1000))
    total = sum(p.stat().st_size for p in cache.objects_dir().glob("*/*"))
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, str(total - 1000))  # room for the new object and one old
    new = stage(f"s3://{bucket}/new/", tmp_path, format="raw")
    assert Path(new.objects[0].path).exists()
    old = [cache.path_for(bucket, f"old{i}/x.bin", new.objects[0].etag) for i in range(3)]
    assert [p.exists() for p in old] == [False, False, True]  # the two least recently used went


def test_room_is_made_before_a_channel_is_fetched_not_only_after(s3_endpoint, tmp_path, monkeypatch):
    # A cache at its cap on a disk that holds little more: the trim after staging came too late, and every
    # rerun failed with the disk full.
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="old/x.bin", Body=bytes(1000))
    client.put_object(Bucket=bucket, Key="new/x.bin", Body=b"n" * 1000)
    kept = stage(f"s3://{bucket}/old/", tmp_path, format="raw").objects[0]
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, "1500")  # room for one of the two
    seen = []
    manifest = listing.list_channel("train", Channel(s3_uri=f"s3://{bucket}/new/", format="raw"))
    with cache.Pin() as pin:
        staging.fetch_channel(manifest, lambda n: seen.append(Path(kept.path).exists()), pin)
    assert seen and not any(seen)  # gone before the first byte of the new channel arrived
    assert Path(manifest.objects[0].path).read_bytes() == b"n" * 1000


def test_two_stagings_of_one_channel_at_once_download_each_object_once(s3_endpoint, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))  # two jobs on one machine share its cache
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for i in range(30):
        client.put_object(Bucket=bucket, Key=f"ch/{i}.bin", Body=bytes([i]) * 5000)
    channel = Channel(s3_uri=f"s3://{bucket}/ch/", format="raw")

    def one_job(_) -> listing.ChannelManifest:
        with cache.Pin() as pin:
            return staging.fetch_channel(listing.list_channel("train", channel), pin=pin)

    with ThreadPoolExecutor(2) as jobs:
        first, second = jobs.map(one_job, range(2))
    assert first.bytes_downloaded + second.bytes_downloaded == 30 * 5000  # (each had fetched nearly all)
    assert first.objects_downloaded + second.objects_downloaded == 30
    for manifest in (first, second):
        assert sorted(Path(o.path).read_bytes()[:1][0] for o in manifest.objects) == list(range(30))
        assert all(o.verified_by for o in manifest.objects)


def test_another_jobs_eviction_spares_the_objects_a_job_has_pinned_until_it_releases_them(
    s3_endpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    for name in ("first", "second"):
        client.put_object(Bucket=bucket, Key=f"{name}/x.bin", Body=name.encode() * 500)
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, "0")  # every object is over the cap
    with cache.Pin() as pin:  # job 1 staged, and still reading what it staged
        first = staging.stage_channels({"train": Channel(s3_uri=f"s3://{bucket}/first/", format="raw")}, tmp_path, pin)
        stage(f"s3://{bucket}/second/", tmp_path / "job2", format="raw")  # job 2 stages and trims the cache
        assert Path(first["train"].objects[0].path).read_bytes() == b"first" * 500
    # released: the cache is trimmed back under its cap at once, not only by the next job's staging
    assert not Path(first["train"].objects[0].path).exists()
    assert not list(cache.pins_dir().glob("*"))


def test_the_cache_cap_takes_units_and_a_malformed_one_fails_before_any_fetch(s3_endpoint, tmp_path, monkeypatch):
    for text, size in (("", cache.DEFAULT_MAX_BYTES), ("1000", 1000), ("500MB", 500 * 10**6), ("100GiB", 100 * 2**30)):
        monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, text)
        assert cache.max_bytes() == size
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, "ten gigs")
    bucket = s3_endpoint.new_bucket()
    s3_endpoint.client().put_object(Bucket=bucket, Key="ch/a.bin", Body=b"x" * 100)
    with pytest.raises(TrainyardError, match="TRAINYARD_CACHE_MAX_BYTES='ten gigs' is not a size.*100GiB"):
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert not list(cache.objects_dir().glob("*/*"))  # nothing was fetched


def test_a_pin_left_by_a_process_that_died_is_removed_by_the_next_eviction(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    obj = cache.path_for("b", "k", "e")
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"x" * 100)
    held = cache.Pin()
    held.add([obj])
    killed = "import os; from trainyard import cache; p = cache.Pin(); p.add([{obj!r}]); os._exit(9)"
    subprocess.run([sys.executable, "-c", killed.format(obj=str(obj))], check=False, cwd=Path(__file__).parents[2])
    assert len(list(cache.pins_dir().glob("*.pin"))) == 2
    assert cache.evict(limit=0)["evicted_objects"] == 0  # still pinned by the live holder
    assert list(cache.pins_dir().glob("*.pin")) == [held.path]  # the dead one's pin is gone
    held.release()
    assert cache.evict(limit=0)["evicted_objects"] == 1 and not obj.exists()


def test_a_download_abandoned_by_a_killed_job_is_removed_at_once_and_one_in_progress_is_not(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    folder = cache.path_for("b", "k", "e").parent
    folder.mkdir(parents=True)
    killed, live = folder / ".x.123.ab.part", folder / ".y.456.cd.part"
    writer = subprocess.Popen(  # a staging killed mid-download (OOM, preemption): its part file stays
        [sys.executable, "-c", WRITE_AND_WAIT, str(killed)],
        stdout=subprocess.PIPE,
        env=os.environ | {"PYTHONPATH": "."},
    )
    assert writer.stdout.readline() == b"writing\n"
    writer.kill()
    writer.wait()
    claim = cache.claim_part(live)  # this process's download, under way
    try:
        os.write(claim, b"y" * 100)
        assert cache.evict()["cache_bytes"] == 100  # the download's room counted; the killed one's gone
        assert not killed.exists() and live.exists()  # at once: the rerun after a kill needs the room
    finally:
        os.close(claim)
    assert cache.evict()["cache_bytes"] == 0 and not live.exists()  # its writer gone (here: its claim closed)


def test_a_claim_left_by_a_process_killed_before_renaming_it_goes(tmp_path, monkeypatch):
    # claim_part makes ".<part>.claim", locks it and renames it to the part's name: a kill in between left it for good
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    folder = cache.path_for("b", "k", "e").parent
    folder.mkdir(parents=True)
    left, making = folder / ".x.123.ab.part.claim", folder / ".y.456.cd.part.claim"
    left.write_bytes(b"")
    making.write_bytes(b"")  # another process's, being claimed right now
    old = time.time() - cache.CLAIM_SECONDS - 5
    os.utime(left, (old, old))
    cache.evict()
    assert not left.exists() and making.exists()
    os.utime(making, (old, old))  # by a file server whose clock is behind: old, but locked
    import fcntl

    held = os.open(making, os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        cache.evict()
        assert making.exists()
    finally:
        os.close(held)


def test_evicting_on_nfs_probes_pins_and_parts_with_locks_a_read_only_file_may_take(tmp_path, monkeypatch):
    # NFS (an EFS or ReadWriteMany TRAINYARD_HOME, as infra/README sets up) takes flock as a byte-range lock: an
    # exclusive one on a file opened read-only is EBADF. The probes asked for one, and every staging failed.
    import fcntl

    from tests.nfs_locks import nfs_flock

    monkeypatch.setattr(fcntl, "flock", nfs_flock(fcntl.flock))
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    pinned, loose = cache.path_for("b", "k", "e"), cache.path_for("b", "k2", "e")
    for path, body in ((pinned, b"x"), (loose, b"y")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body * 100)
    held = cache.Pin()
    held.add([pinned])
    dead = cache.pins_dir() / "dead.pin"  # its holder gone: nobody holds its lock
    dead.write_text(f"{loose}\n")
    abandoned = pinned.parent / ".z.789.ef.part"
    abandoned.write_bytes(b"z" * 100)
    assert cache.evict(limit=0)["evicted_objects"] == 1  # the loose one; the pinned one stays
    assert pinned.exists() and not loose.exists() and not dead.exists() and not abandoned.exists()
    held.release()


WRITE_AND_WAIT = """
import os, sys, time
from pathlib import Path
from trainyard import cache
os.write(cache.claim_part(Path(sys.argv[1])), b"x" * 100)
print("writing", flush=True)
time.sleep(60)
"""


def test_a_pin_added_while_an_eviction_runs_waits_for_it_and_then_holds(tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    obj = cache.path_for("b", "k", "e")
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"x" * 100)
    with cache.Pin() as pin:
        with cache._eviction_lock(cache.fcntl.LOCK_EX):  # an eviction is under way
            adding = threading.Thread(target=pin.add, args=([obj],))
            adding.start()
            adding.join(0.5)
            assert adding.is_alive()  # add waits: what the eviction deletes meanwhile is looked up afterwards
        adding.join()
        assert cache.pinned() == {str(obj)}
        assert cache.evict(limit=0)["evicted_objects"] == 0
    assert cache.pinned() == set()  # released on leaving the block


def test_a_cached_object_written_to_since_it_was_verified_is_fetched_again(s3_endpoint, tmp_path, monkeypatch):
    import os
    import time

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="raw/a.bin", Body=b"GOODGOODGOOD")
    first = stage(f"s3://{bucket}/raw/", tmp_path, format="raw")
    cached = Path(first.objects[0].path)
    assert stage(f"s3://{bucket}/raw/", tmp_path, format="raw").objects_downloaded == 0  # a plain re-stage: a hit
    # A root entrypoint writes through its hard link despite the read-only mode (as root ignores it).
    laid_out = raw_layout.mirror(first, tmp_path / "job-folder") / "a.bin"
    os.chmod(laid_out, 0o644)
    time.sleep(0.05)  # past the file system's timestamp tick (a few ms): a write any later changes the mtime
    laid_out.write_bytes(b"EVILGOODGOOD")  # same size: a size check alone would take it
    again = stage(f"s3://{bucket}/raw/", tmp_path, format="raw")
    assert again.objects_downloaded == 1
    assert cached.read_bytes() == b"GOODGOODGOOD"  # the cache holds S3's bytes again


def test_with_cache_verify_a_cached_copy_changed_unseen_is_fetched_again(s3_endpoint, tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"GOODGOODGOOD")
    big = put_big(client, bucket, "ch/big.bin", tmp_path)  # multipart: moto's composite checksum, by its parts
    first = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    for obj in first.objects:  # a bit flip on the disk: the same size, and the modification time unchanged
        path = Path(obj.path)
        st = path.stat()
        os.chmod(path, 0o644)
        with path.open("r+b") as f:
            f.seek(obj.size // 2)
            f.write(b"\x00")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    unverified = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert unverified.objects_downloaded == 0  # by default a hit is its size and modification time
    monkeypatch.setenv(cache.CACHE_VERIFY_ENV, "1")
    verified = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert verified.objects_downloaded == 2
    assert sorted(verified.cache_mismatches) == [f"s3://{bucket}/ch/a.bin", f"s3://{bucket}/ch/big.bin"]
    assert verified.summary()["cache_mismatches"] == verified.cache_mismatches
    contents = {Path(o.key).name: Path(o.path).read_bytes() for o in verified.objects}
    assert contents == {"a.bin": b"GOODGOODGOOD", "big.bin": big}
    again = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")  # whole again: hits, checked as when fetched
    assert again.objects_downloaded == 0 and again.cache_mismatches == []
    assert all(o.verified_by.startswith("cache, verified again (size+") for o in again.objects)
    os.removexattr(again.objects[0].path, cache.META_XATTR)  # as cached by an older Trainyard: nothing kept
    unverifiable = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert unverifiable.cache_unverifiable == [again.objects[0].uri] and unverifiable.cache_mismatches == []
    assert unverifiable.objects_downloaded == 1
    monkeypatch.setenv(cache.CACHE_VERIFY_ENV, "sometimes")
    with pytest.raises(TrainyardError, match="TRAINYARD_CACHE_VERIFY='sometimes' is neither on nor off"):
        stage(f"s3://{bucket}/ch/", tmp_path, format="raw")


def test_an_object_s3_gave_only_a_size_for_is_checked_again_against_its_bytes_as_fetched(
    s3_endpoint, tmp_path, monkeypatch
):
    import os

    from botocore.config import Config

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    # a multipart upload with no flexible checksum (as older SDKs and MinIO clients write): on moto its ETag is
    # no MD5 and it has no checksum, so staging can check its size alone
    bare = s3_endpoint.client(Config(request_checksum_calculation="when_required"))
    bucket = s3_endpoint.new_bucket()
    big = put_big(bare, bucket, "ch/big.bin", tmp_path)
    first = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    path = Path(first.objects[0].path)
    st = path.stat()
    os.chmod(path, 0o644)
    with path.open("r+b") as f:  # a bit flip on the disk: the same size, and the modification time unchanged
        f.seek(len(big) // 2)
        f.write(b"\x00")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setenv(cache.CACHE_VERIFY_ENV, "1")
    verified = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert verified.cache_mismatches == [f"s3://{bucket}/ch/big.bin"] and verified.objects_downloaded == 1
    assert Path(verified.objects[0].path).read_bytes() == big
    again = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert again.objects_downloaded == 0 and again.objects[0].verified_by.startswith("cache, verified again (size")


def test_a_channel_over_the_cap_staged_without_a_pin_is_there_when_staging_returns(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cache.CACHE_MAX_BYTES_ENV, "100")  # the channel alone is over the cap
    client = s3_endpoint.client()
    bucket = s3_endpoint.new_bucket()
    client.put_object(Bucket=bucket, Key="ch/a.bin", Body=b"x" * 1000)
    staged = stage(f"s3://{bucket}/ch/", tmp_path, format="raw")
    assert Path(staged.objects[0].path).read_bytes() == b"x" * 1000


def test_an_object_linked_into_a_jobs_folder_is_not_evicted_as_if_that_freed_its_room(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "home"))
    linked, alone = cache.path_for("b", "raw", "e1"), cache.path_for("b", "other", "e2")
    for path in (linked, alone):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
    os.link(linked, tmp_path / "mirror")  # a raw channel's file in a job's folder (raw_layout.mirror)
    evicted = cache.evict(limit=0)
    assert linked.exists() and not alone.exists() and evicted["evicted_bytes"] == 100
    (tmp_path / "mirror").unlink()  # the job's folder cleaned up: the cache's copy is its own again
    assert cache.evict(limit=0)["evicted_objects"] == 1 and not linked.exists()
