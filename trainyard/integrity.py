"""Checking downloaded bytes against what S3 says of them.

S3 offers two records: the ETag, which is the MD5 of the bytes for a single-part upload (a
multipart ETag, ``<md5 of part md5s>-<parts>``, is not), and the flexible checksums
(``x-amz-checksum-<algorithm>``, any of ``ALGORITHMS``) where the object has one. A full-object
checksum covers the whole body; a composite one (``...-<parts>``) only its parts, so it cannot be
checked against the whole file.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

from awscrt import checksums as crt


class _Crc:
    """A running CRC (zlib's or awscrt's) with hashlib's update / digest, in S3's big-endian bytes."""

    def __init__(self, crc, size: int):
        self._crc, self._size, self._value = crc, size, 0

    def update(self, data: bytes) -> None:
        self._value = self._crc(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(self._size, "big")


class _XxHash:
    """awscrt's xxhash (as botocore computes S3's) with hashlib's update / digest; digest finalizes it."""

    def __init__(self, new):
        self._state = new()

    def update(self, data: bytes) -> None:
        self._state.update(data)

    def digest(self) -> bytes:
        return self._state.finalize()


# S3's flexible checksum algorithms (its ChecksumAlgorithm values, named as boto3 names the response
# fields, Checksum<ALGORITHM>), each with a new running hash of it. An object has at most one.
_NEW_HASH: dict[str, Callable[[], Any]] = {  # each has update(bytes) and digest()
    "CRC64NVME": lambda: _Crc(crt.crc64nvme, 8),
    "CRC32": lambda: _Crc(zlib.crc32, 4),
    "CRC32C": lambda: _Crc(crt.crc32c, 4),
    "SHA256": lambda: hashlib.sha256(usedforsecurity=False),
    "SHA1": lambda: hashlib.sha1(usedforsecurity=False),
    "SHA512": lambda: hashlib.sha512(usedforsecurity=False),
    "MD5": lambda: hashlib.md5(usedforsecurity=False),
    "XXHASH64": lambda: _XxHash(crt.XXHash.new_xxhash64),
    "XXHASH3": lambda: _XxHash(crt.XXHash.new_xxhash3_64),
    "XXHASH128": lambda: _XxHash(crt.XXHash.new_xxhash3_128),
}
ALGORITHMS = tuple(_NEW_HASH)
LOCAL_ALGORITHM = "CRC64NVME"  # the fastest here (awscrt's), for bytes S3 gave no checksum of


class _Hasher:
    """An incremental hash of one of S3's checksum algorithms, giving S3's base64 form."""

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self._state = _NEW_HASH[algorithm]()
        self._digest: bytes | None = None

    def update(self, data: bytes) -> None:
        self._state.update(data)

    def digest(self) -> bytes:
        if self._digest is None:  # once: an xxhash is finalized by it
            self._digest = self._state.digest()
        return self._digest

    def b64digest(self) -> str:
        return base64.b64encode(self.digest()).decode()


def checksum_of(response: dict) -> dict | None:
    """The flexible checksum in a GetObject / HeadObject response, if the object has one.

    Without an ``x-amz-checksum-type`` header (botocore reads it from 1.36, the floor in pyproject.toml; an
    S3-compatible endpoint may not send it), a checksum of a multipart object (its ETag ends in
    ``-<parts>``) is taken as composite: some endpoints send a composite value without its suffix. Not a
    CRC64NVME, which S3 keeps only of the whole object (a composite one could never match it). Without its
    ``-<parts>`` suffix either, it may as well be a full-object one (S3's for a CRC32 upload that asked for it):
    ``guessed``, and the bytes pass matching either.
    """
    multipart = "-" in str(response.get("ETag", ""))
    for algorithm in ALGORITHMS:
        value = response.get(f"Checksum{algorithm}")
        if value:
            guess = "COMPOSITE" if ("-" in value or multipart) and algorithm != "CRC64NVME" else "FULL_OBJECT"
            kind = response.get("ChecksumType") or guess
            found = {"algorithm": algorithm, "value": value, "type": kind}
            if not response.get("ChecksumType") and kind == "COMPOSITE" and "-" not in value:
                found["guessed"] = True  # either kind: the bytes are checked against both (``Digester``)
            return found
    return None


class Digester:
    """The size and one digest of an object's bytes, computed in order (as they arrive, for an object
    fetched with one GET), to check against S3's record of it.

    The digest is S3's flexible checksum where the object has one that can be checked against the
    whole body (a full-object one, or a composite one whose part sizes are known), else the MD5 of a
    single-part ETag. One is enough to catch corrupt bytes, and MD5 is the slowest of them: about
    0.8 GB/s on one core, against 2 GB/s for SHA-256 and 7-28 GB/s for the CRCs here. S3 gives every
    new object a CRC64NVME, so on S3 staging rarely computes an MD5.
    """

    def __init__(self, etag: str, checksum: dict | None, part_sizes: list[int] | None = None, local: str | None = None):
        self.etag, self.checksum, self.size = etag, checksum, 0
        self.part_sizes = list(part_sizes) if part_sizes else None  # kept with a cached object (re-verification)
        full = checksum if checksum and (checksum["type"] == "FULL_OBJECT" or part_sizes) else None
        self.full = full
        self.md5 = hashlib.md5(usedforsecurity=False) if _is_md5_etag(etag) and not full else None
        self.hasher: _Hasher | _Composite | None = None
        # a checksum whose kind the endpoint did not say (``checksum_of``): the whole body's too, either matching
        self.whole = _Hasher(checksum["algorithm"]) if checksum and checksum.get("guessed") else None
        if full:
            # a composite checksum is checked only with its part sizes (else `full` is None)
            composite = full["type"] == "COMPOSITE"
            self.hasher = (
                _Composite(full["algorithm"], part_sizes) if composite and part_sizes else _Hasher(full["algorithm"])
            )
        # Where S3 gives nothing to check but the size (a multipart upload without a flexible checksum, an SSE-KMS
        # object without one), a checksum of the bytes as they arrived, kept with the cached copy: a later
        # TRAINYARD_CACHE_VERIFY then finds a bit flip on this disk. ``local``: that checksum, to check against.
        self.local = _Hasher(LOCAL_ALGORITHM) if not self.md5 and not self.hasher else None
        self.local_expected = local

    def update(self, data: bytes) -> None:
        self.size += len(data)
        if self.md5:
            self.md5.update(data)
        if self.hasher:
            self.hasher.update(data)
        if self.whole:
            self.whole.update(data)
        if self.local:
            self.local.update(data)

    @property
    def local_checksum(self) -> str | None:
        """The bytes' own checksum (``LOCAL_ALGORITHM``, base64) where S3 gave none to check, else None."""
        return self.local.b64digest() if self.local else None

    def result(self, expected_size: int) -> tuple[str | None, str]:
        """``(problem or None, what was checked)``."""
        if self.size != expected_size:
            return f"size {self.size} != {expected_size}", "size"
        checked = ["size"]
        if self.md5:
            if self.md5.hexdigest() != self.etag.lower():
                return f"MD5 {self.md5.hexdigest()} != ETag {self.etag}", "size+md5"
            checked.append("md5")
        full, said = self.full, self.checksum or {}
        if self.whole and self.whole.b64digest() == said.get("value"):  # (a guessed kind: see checksum_of)
            checked.append(said["algorithm"].lower())  # a full-object checksum, after all
        elif self.hasher and full:  # (a hasher only with a full checksum)
            expected = full["value"].split("-")[0]
            if self.hasher.b64digest() != expected:
                return f"{full['algorithm']} {self.hasher.b64digest()} != {expected}", "+".join(checked)
            composite = "-composite" if full["type"] == "COMPOSITE" else ""
            checked.append(full["algorithm"].lower() + composite)
        if self.local and self.local_expected:  # against the bytes as first fetched, not against S3
            if self.local.b64digest() != self.local_expected:
                return f"{LOCAL_ALGORITHM} {self.local.b64digest()} != {self.local_expected} when fetched", "+".join(
                    checked
                )
            checked.append(f"{LOCAL_ALGORITHM.lower()}-as-fetched")
        return None, "+".join(checked)


class _Composite:
    """S3's composite checksum: each part hashed alone, then the hash of the parts' digests."""

    def __init__(self, algorithm: str, part_sizes: list[int]):
        self.algorithm, self._sizes = algorithm, list(part_sizes)
        self._part, self._left, self._digests = _Hasher(algorithm), self._sizes.pop(0), b""

    def update(self, data: bytes) -> None:
        while data:
            take = data[: self._left]
            self._part.update(take)
            self._left -= len(take)
            data = data[len(take) :]
            if self._left == 0 and self._sizes:
                self._next_part()
            elif self._left == 0 and data:
                return  # more bytes than the parts add up to (the object changed): the size check says so

    def _next_part(self) -> None:
        self._digests += self._part.digest()
        self._part, self._left = _Hasher(self.algorithm), self._sizes.pop(0) if self._sizes else 0

    def b64digest(self) -> str:
        outer = _Hasher(self.algorithm)
        outer.update(self._digests + self._part.digest())
        return outer.b64digest()


def md5_etag(etag: str, response: dict) -> str:
    """``etag`` where it is the MD5 of the bytes (as for a single-part upload), else ``""``: the ETag of an
    object encrypted with SSE-KMS or SSE-C is not its MD5, and checking it would reject good bytes."""
    if response.get("SSECustomerAlgorithm") or str(response.get("ServerSideEncryption", "")).startswith("aws:kms"):
        return ""
    return etag


def _is_md5_etag(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower())


class FollowingDigest:
    """A seekable file for the transfer manager to write parts into, at their offsets, in any order,
    while a thread digests the bytes in order as soon as a contiguous prefix of them has landed.

    This overlaps the digest with the download instead of reading the whole file again after it.
    (A non-seekable writer that took the parts in order would be simpler, but s3transfer 0.19 holds
    at most 10 parts in memory for one and deadlocks past that.) A byte range written twice (a part
    the transfer manager retried) may have been digested in its first form: ``rewritten`` says so,
    and the caller then digests the finished file in one pass instead.
    """

    CHUNK = 4 << 20

    def __init__(self, path, update):
        self._file = open(path, "wb", buffering=0)  # unbuffered: the follower reads what was written  # noqa: SIM115 (closed by close())
        self._reader = os.open(path, os.O_RDONLY)
        self._update = update
        self._pos = self._prefix = self._digested = 0
        self._extents: dict[int, int] = {}  # start -> end of written ranges past the prefix
        self._done = False
        self._error: BaseException | None = None
        self.rewritten = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._follow, name="trainyard-digest", daemon=True)
        self._thread.start()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self._file.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        start, view = self._pos, memoryview(data)
        while view:
            view = view[self._file.write(view) :]
        end = self._pos = start + len(data)
        with self._cv:
            if start < self._prefix or any(s < end and start < e for s, e in self._extents.items()):
                self.rewritten = True
            self._extents[start] = max(end, self._extents.get(start, end))
            while self._prefix in self._extents:
                self._prefix = self._extents.pop(self._prefix)
            self._cv.notify()
        return len(data)

    def _follow(self) -> None:
        try:
            while True:
                with self._cv:
                    while self._digested >= self._prefix and not self._done:
                        self._cv.wait()
                    upto = self._prefix
                    if self._digested >= upto:
                        return
                while self._digested < upto:
                    chunk = os.pread(self._reader, min(self.CHUNK, upto - self._digested), self._digested)
                    if not chunk:
                        raise OSError(f"{self._file.name}: shorter than the bytes written to it")
                    self._update(chunk)
                    self._digested += len(chunk)
        except BaseException as exc:  # handed to close(), in the caller's thread
            self._error = exc

    def close(self) -> None:
        """Wait for the digest to catch up with everything written, then close the file."""
        with self._cv:
            self._done = True
            self._cv.notify()
        self._thread.join()
        self._file.close()
        os.close(self._reader)
        if self._error is not None:
            raise self._error
