"""The digest that follows a file the transfer manager writes out of order."""

from __future__ import annotations

import hashlib
import random

from trainyard.integrity import FollowingDigest


def test_parts_written_out_of_order_are_digested_in_order(tmp_path):
    data = random.Random(0).randbytes(3 * FollowingDigest.CHUNK + 12345)
    parts = [(i, data[i : i + 1_000_003]) for i in range(0, len(data), 1_000_003)]
    random.Random(1).shuffle(parts)
    digest = hashlib.md5()
    target = FollowingDigest(tmp_path / "f", digest.update)
    for offset, part in parts:
        target.seek(offset)
        assert target.write(part) == len(part)
    target.close()
    assert digest.hexdigest() == hashlib.md5(data).hexdigest()
    assert (tmp_path / "f").read_bytes() == data and not target.rewritten


def test_a_range_written_twice_is_reported(tmp_path):
    target = FollowingDigest(tmp_path / "f", lambda chunk: None)
    target.write(b"a" * 10)
    target.seek(0)
    target.write(b"b" * 5)  # a retried part, written again from its start
    target.close()
    assert target.rewritten


def test_a_gap_leaves_the_rest_undigested(tmp_path):
    seen = bytearray()
    target = FollowingDigest(tmp_path / "f", seen.extend)
    target.seek(10)
    target.write(b"x" * 10)
    target.close()
    assert seen == b""  # the first 10 bytes never came: the size check names the object
