"""The digest that follows a file the transfer manager writes out of order."""

from __future__ import annotations

import base64
import hashlib
import random
import zlib

import pytest

from trainyard.integrity import ALGORITHMS, Digester, FollowingDigest


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


def test_one_digest_is_computed_the_flexible_checksum_where_s3_has_one_else_the_md5():
    data = b"trainyard" * 1000
    etag = hashlib.md5(data).hexdigest()
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    cases = [
        ({"algorithm": "CRC32", "value": crc, "type": "FULL_OBJECT"}, "size+crc32"),
        ({"algorithm": "CRC32", "value": crc + "-2", "type": "COMPOSITE"}, "size+md5"),  # part sizes unknown
        (None, "size+md5"),
    ]
    for checksum, checked in cases:
        digester = Digester(etag, checksum)
        digester.update(data)
        assert digester.result(len(data)) == (None, checked)
        assert (digester.md5 is None) is (checked != "size+md5")
    wrong = Digester(etag, {"algorithm": "CRC32", "value": crc, "type": "FULL_OBJECT"})
    wrong.update(data[:-1] + b"X")
    problem, _ = wrong.result(len(data))
    assert problem.startswith("CRC32 ")


@pytest.mark.timeout(20)
def test_more_bytes_than_the_composite_parts_add_up_to_is_a_size_mismatch_not_a_hang():
    # The object was replaced by a larger one after its part sizes were read.
    part = b"abcd"
    crc = base64.b64encode(zlib.crc32(part).to_bytes(4, "big")).decode()
    digester = Digester("0" * 32 + "-1", {"algorithm": "CRC32", "value": crc + "-1", "type": "COMPOSITE"}, [4])
    digester.update(part + b"e")
    digester.update(b"fgh")
    assert digester.result(4) == ("size 8 != 4", "size")


def test_the_etag_of_an_encrypted_object_is_not_taken_for_its_md5():
    from trainyard.integrity import md5_etag

    data = b"encrypted at rest"
    not_md5 = "0123456789abcdef0123456789abcdef"  # what S3 gives an SSE-KMS or SSE-C object
    for response in ({"ServerSideEncryption": "aws:kms"}, {"ServerSideEncryption": "aws:kms:dsse"}):
        digester = Digester(md5_etag(not_md5, response), None)
        digester.update(data)
        assert digester.result(len(data)) == (None, "size")
    assert md5_etag(not_md5, {"SSECustomerAlgorithm": "AES256"}) == ""
    plain = hashlib.md5(data).hexdigest()
    assert md5_etag(plain, {"ServerSideEncryption": "AES256"}) == plain  # SSE-S3: the ETag is the MD5
    digester = Digester(plain.upper(), None)  # hex digits in either case
    digester.update(data)
    assert digester.result(len(data)) == (None, "size+md5")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_s3_checksum_algorithm_is_computed_as_botocore_computes_it(algorithm):
    # botocore's classes are what an AWS SDK puts on an upload: S3 stores that value. The bytes come in
    # uneven chunks, as a download's do; a composite checksum is the hash of its parts' digests.
    from botocore import httpchecksum

    # (its own table has the CRT ones only where its awscrt check passes: they are named here)
    reference = {
        "CRC64NVME": httpchecksum.CrtCrc64NvmeChecksum,
        "CRC32": httpchecksum.Crc32Checksum,
        "CRC32C": httpchecksum.CrtCrc32cChecksum,
        "SHA256": httpchecksum.Sha256Checksum,
        "SHA1": httpchecksum.Sha1Checksum,
        "SHA512": httpchecksum.Sha512Checksum,
        "MD5": hashlib.md5,  # (botocore has no class of its own for it)
        "XXHASH64": httpchecksum.CrtXxhash64Checksum,
        "XXHASH3": httpchecksum.CrtXxhash3Checksum,
        "XXHASH128": httpchecksum.CrtXxhash128Checksum,
    }[algorithm]
    rng = random.Random(algorithm)
    data = rng.randbytes(300_001)
    whole = reference()
    whole.update(data)
    full = {"algorithm": algorithm, "value": base64.b64encode(whole.digest()).decode(), "type": "FULL_OBJECT"}
    parts = [100_000, 100_000, 100_001]
    digests = b""
    for start, size in zip((0, 100_000, 200_000), parts, strict=True):
        part = reference()
        part.update(data[start : start + size])
        digests += part.digest()
    outer = reference()
    outer.update(digests)
    composite = {"algorithm": algorithm, "value": f"{base64.b64encode(outer.digest()).decode()}-3", "type": "COMPOSITE"}
    name = algorithm.lower()
    for checksum, sizes, checked in ((full, None, f"size+{name}"), (composite, parts, f"size+{name}-composite")):
        digester = Digester("0" * 32 + "-3", checksum, sizes)
        at = 0
        while at < len(data):
            step = rng.randint(1, 70_000)
            digester.update(data[at : at + step])
            at += step
        assert digester.result(len(data)) == (None, checked)
        wrong = Digester("0" * 32 + "-3", checksum, sizes)
        wrong.update(data[:-1] + bytes([data[-1] ^ 1]))
        problem, _ = wrong.result(len(data))
        assert problem.startswith(f"{algorithm} ") and problem.endswith(checksum["value"].split("-")[0])


def test_a_multipart_objects_checksum_without_its_type_is_composite_but_a_crc64nvme_whole():
    from trainyard.integrity import checksum_of

    multipart = {"ETag": '"abc-3"'}  # an endpoint that sends no x-amz-checksum-type
    assert checksum_of(multipart | {"ChecksumCRC32": "AAAAAA=="})["type"] == "COMPOSITE"
    # S3 keeps a CRC64NVME of the whole object only: a composite one, computed from the parts, never matched
    assert checksum_of(multipart | {"ChecksumCRC64NVME": "AAAAAAAAAAA="})["type"] == "FULL_OBJECT"
    said = multipart | {"ChecksumCRC32": "AAAAAA==", "ChecksumType": "FULL_OBJECT"}
    assert checksum_of(said)["type"] == "FULL_OBJECT"


def test_a_multipart_objects_checksum_of_unsaid_kind_passes_good_bytes_of_either_kind_and_no_bad_ones():
    # an endpoint that sends no x-amz-checksum-type: a multipart object's CRC32 without a "-<parts>" suffix was
    # taken for a composite one, and good bytes whose CRC32 was the whole object's failed their check
    from trainyard.integrity import checksum_of

    data = random.Random(2).randbytes(3000)
    sizes = [1000, 1000, 1000]

    def b64(crc: int) -> str:
        return base64.b64encode(crc.to_bytes(4, "big")).decode()

    whole = b64(zlib.crc32(data))
    parts = b"".join(zlib.crc32(data[i : i + 1000]).to_bytes(4, "big") for i in range(0, 3000, 1000))
    composite = b64(zlib.crc32(parts))
    for value, kind in ((whole, "crc32"), (composite, "crc32-composite")):
        checksum = checksum_of({"ETag": '"abc-3"', "ChecksumCRC32": value})
        assert checksum["type"] == "COMPOSITE" and checksum.get("guessed")
        for part_sizes in (sizes, None):  # (the part sizes are not always to be had)
            good = Digester("abc-3", checksum, part_sizes)
            good.update(data)
            problem, checked = good.result(len(data))
            assert problem is None
            if part_sizes or kind == "crc32":
                assert checked == f"size+{kind}"
            bad = Digester("abc-3", checksum, sizes)
            bad.update(data[:-1] + b"X")
            assert bad.result(len(data))[0].startswith("CRC32 ")
    # said, or with its suffix: one kind only
    said = checksum_of({"ETag": '"abc-3"', "ChecksumCRC32": whole, "ChecksumType": "COMPOSITE"})
    suffixed = checksum_of({"ETag": '"abc-3"', "ChecksumCRC32": composite + "-3"})
    assert "guessed" not in said and "guessed" not in suffixed
    strict = Digester("abc-3", said, sizes)
    strict.update(data)
    assert strict.result(len(data))[0].startswith("CRC32 ")
