"""``mode: stream``: train on parquet row groups read straight from S3, so training starts before the
channel is fully read.

Staging reads only the parquet footers (row counts per row group), the label column (the classes)
and the first row groups (the feature scaling); nothing else is downloaded. Each replica group then
reads the row groups of its share as it needs them, one ahead in a background thread, and keeps what
it read in the machine's cache (``cache.rowgroups_dir``, under the cache's one size cap), so later epochs,
and later jobs that read the same objects the same way, do not go back to S3. The step count per epoch comes from the
footers, so every group agrees on it without reading anything.

A row group kept on disk is its two arrays as plain ``.npy`` records, one after the other (features,
then labels), not an ``.npz``: a zip member is checksummed (CRC-32) on every write and every read,
which took most of the 25 ms that saving and reloading one 256Ki-row group cost before its first batch.
It is mapped back read-only (``np.memmap``), not read: see ``_load``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from trainyard import cache, datasets, kept_rowgroups, parallel, progress, s3, sharding, stream_sample, table_checks
from trainyard.errors import DataError, StorageError
from trainyard.listing import MAX_CONCURRENT_OBJECTS, ChannelManifest, StagedObject
from trainyard.spec import Channel

log = logging.getLogger(__name__)

SAMPLE_ROWS = 20_000  # rows read at staging to fit the built-in models' feature scaling


_bucket_regions: dict[str, str] = {}  # bucket -> region, as S3 said once in this process


def arrow_filesystem(bucket: str | None = None) -> pafs.S3FileSystem:
    """pyarrow's S3 file system, configured from the same standard AWS settings boto3 resolves, to read
    ``bucket``. On AWS with no region configured, the region is the bucket's, asked of S3 (once per
    bucket and process): boto3 follows S3's redirect to a bucket in another region, pyarrow does not, so
    a bucket that file mode reads would fail in stream mode (301). Other endpoints take the region as is."""
    # As for boto3 (s3.py): the AWS SDK's own response-checksum check misfires on ranged GETs from
    # endpoints that send the whole object's checksum with each range. Set explicitly, it is kept.
    os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    frozen = s3.credentials()
    client = s3.client()
    endpoint = urlparse(client.meta.endpoint_url)
    region = client.meta.region_name or "us-east-1"
    if _on_aws(endpoint.hostname) and bucket and not s3.configured_region():
        if bucket not in _bucket_regions and (found := s3.bucket_region(client, bucket)):
            _bucket_regions[bucket] = found  # not kept where S3 said nothing: asked again next time
        region = _bucket_regions.get(bucket, region)
    kwargs: dict = {"region": region, "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=8)}
    if frozen:
        kwargs |= {"access_key": frozen.access_key, "secret_key": frozen.secret_key, "session_token": frozen.token}
    if not _on_aws(endpoint.hostname):
        # host[:port] only: Arrow takes no userinfo (botocore ignores any in the URL, so this does too)
        kwargs |= {"endpoint_override": endpoint.netloc.rpartition("@")[2], "scheme": endpoint.scheme}
    return pafs.S3FileSystem(**kwargs)


_on_aws = s3.on_aws  # AWS's own endpoint: pyarrow then finds it from the region


def describe(
    manifest: ChannelManifest, channel: Channel, task: str, out_dir: Path, cache_dir: Path | None = None
) -> datasets.StagedData:
    """Read what streaming needs without downloading the channel: footers, classes, a scaling sample.

    The sample is about ``SAMPLE_ROWS`` rows, whole row groups spread through the channel (``stream_sample``; the
    layout's ``sampled`` names them). They are kept in ``cache_dir`` (the groups' row-group cache), and the first
    epoch starts with them, so the first batch needs no further read from S3. The label column is read for the
    class list unless the channel declares its ``classes``. Every object's footer is checked for the columns
    training reads, so an object without them fails here, named, not hours into training.
    """
    if manifest.format != "parquet":
        raise DataError(f"channel {manifest.name!r}: mode stream reads parquet row groups; set format parquet")
    where = f"channel {manifest.name!r} ({manifest.uri})"
    filesystem = functools.cache(arrow_filesystem)  # one per bucket: a manifest's may be in other regions

    layout: list[dict] = []
    start = 0
    sample: list[tuple[str, str, pa.Table]] = []  # (row group id, ETag, its rows): stream_sample.spread picks them
    schemas: dict[str, pa.Schema] = {}
    for obj, (parquet, size, etag) in _opened(manifest, filesystem):
        _check_unchanged(parquet, size, etag, {"id": obj.uri, "etag": obj.etag, "size": obj.size}, "listed")
        table_checks.check_unique_columns(obj.uri, parquet.schema_arrow.names)
        counts = _row_counts(parquet)
        layout.append(
            {
                "id": obj.uri,
                "etag": obj.etag,
                "size": obj.size,
                "start": start,
                "end": start + sum(counts),
                "row_groups": counts,
            }
        )
        schemas[obj.uri] = parquet.schema_arrow
        start += sum(counts)
    if start == 0:
        raise DataError(f"{where}: the objects hold no rows")
    sample_layout = stream_sample.pick(layout, SAMPLE_ROWS)  # (marks the layout's entries: "sampled")
    wanted = [(obj, entry) for obj, entry in zip(manifest.objects, layout, strict=True) if entry.get("sampled")]
    for groups in parallel.in_threads(lambda o: _sample_of(*o, filesystem), wanted, MAX_CONCURRENT_OBJECTS):
        sample += groups
    try:
        # category columns as their values (file mode's rule): one object's category and another's text are one column
        table = pa.concat_tables([table_checks.decoded(t) for *_, t in sample], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        uris = [unit.rpartition("#rg")[0] for unit, *_ in sample]
        raise table_checks.disagreement(where, uris, [t.schema for *_, t in sample], exc) from exc
    # An object without a column the spec names is named (the sample's concatenation would show it only
    # as missing values); a column in no object is the spec's, and the inferred features are checked below.
    table_checks.check_objects_have(table_checks.required_columns(channel), {u: s.names for u, s in schemas.items()})
    # Column types are checked where there are values: an empty object's columns may be typed null
    with_rows = {entry["id"]: schemas[entry["id"]] for entry in layout if entry["end"] > entry["start"]}
    classes, label = channel.classes, channel.label
    if label is not None and label in table.column_names:
        _check_objects(schemas, [label])
        _check_one_label_kind(with_rows, label)
    if task == "classification" and not classes and label is not None and label in table.column_names:
        # From the whole label column, not the sample: a channel written sorted by label has one class in its
        # first rows. Only the label column is read: parquet fetches just its column chunks.
        _check_objects(schemas, [label])
        # Only objects with rows, and one label type for them all: an empty pandas shard's string column is
        # typed null, and the dataset would cast every other object's labels to the first object's type.
        holding = [o for o, entry in zip(manifest.objects, layout, strict=True) if entry["end"] > entry["start"]]
        try:
            label_type = pa.unify_schemas(
                [pa.schema([schemas[o.uri].field(label)]) for o in holding], promote_options="permissive"
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # (dictionary and string, bool and int): as before,
            label_type = pa.schema([schemas[holding[0].uri].field(label)])  # the first object's type
        by_bucket: dict[str, list] = {}
        for o in holding:
            by_bucket.setdefault(o.bucket, []).append(o)
        held = {entry["id"]: entry["end"] - entry["start"] for entry in layout}
        label_layout, at = [], 0  # where each object's labels lie in the table read below, to name a bad one's
        for o in (o for objects in by_bucket.values() for o in objects):
            label_layout.append({"id": o.uri, "start": at, "end": at + held[o.uri]})
            at += held[o.uri]
        try:
            labels = pa.concat_tables(
                pq.read_table(
                    [f"{o.bucket}/{o.key}" for o in objects],
                    columns=[label],
                    schema=label_type,
                    filesystem=filesystem(bucket),
                )
                for bucket, objects in by_bucket.items()
            )
        except (OSError, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise read_error(exc, where, "the label column cannot be read") from exc
        datasets.check_labels(labels, label, where, label_layout)
        classes = datasets.found_classes(labels[label], f"{where}: label {label!r}")
    schema = datasets.infer_schema(
        table, channel.model_copy(update={"classes": classes}), task, manifest.name, sample_layout
    )
    if channel.features is None:  # inferred from the sample's row groups: a column some objects lack is named
        table_checks.check_objects_share_numeric(with_rows, channel.label)
    _check_objects(schemas, [*schema.features, schema.label])
    _check_objects(with_rows, [], schema.features)
    x, y = datasets.to_arrays(table, schema, where, sample_layout)
    if cache_dir is not None:
        offset = 0
        for unit_id, etag, part in sample:
            rows = slice(offset, offset + part.num_rows)
            kept_rowgroups.save(kept_rowgroups.path(cache_dir, unit_id, etag, schema), x[rows], y[rows])
            offset += part.num_rows
    out_dir.mkdir(parents=True, exist_ok=True)
    sample_path = out_dir / "train.sample.npz"
    evenly = np.unique(np.linspace(0, len(x) - 1, min(len(x), SAMPLE_ROWS)).round().astype(np.int64))
    np.savez(sample_path, x=x[evenly], y=y[evenly])
    meta = datasets.schema_dict(schema)
    warnings = table_checks.left_out_columns(table, channel, manifest.name, sample_layout)  # a writer's typing
    return datasets.StagedData(str(sample_path), None, meta, {"train": start}, layout, streamed=True, warnings=warnings)


def _sample_of(obj: StagedObject, entry: dict, filesystem) -> list[tuple[str, str, pa.Table]]:
    """The row groups of ``obj`` the scaling sample takes (``entry["sampled"]``): opened again, checked unchanged."""
    parquet, size, etag = _open(filesystem(obj.bucket), f"{obj.bucket}/{obj.key}", listed=True)
    _check_unchanged(parquet, size, etag, entry, "listed")  # (its row groups too: where the endpoint sends no ETag)
    return [(f"{obj.uri}#rg{i}", obj.etag, _read_row_group(parquet, i, obj.uri)) for i in entry["sampled"]]


def _check_objects(schemas: dict[str, pa.Schema], columns: list[str], numeric: Sequence[str] = ()) -> None:
    """Each object has ``columns``, and those in ``numeric`` are numeric: else fail naming the object."""
    for uri, schema in schemas.items():
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise DataError(f"{uri}: columns {missing} not found; columns are {schema.names}")
        for name in numeric:
            if not table_checks.is_numeric(schema.field(name).type):
                raise DataError(f"{uri}: feature {name!r} is {schema.field(name).type}, not numeric; encode it")


def _check_one_label_kind(schemas: dict[str, pa.Schema], label: str) -> None:
    """Every object's ``label`` is text, or every one's is a number (or a bool): else fail naming the first that
    differs. The groups read each row group as its object types it, and staging reads the whole label column at
    one type, casting ``"0"`` to ``0``: the classes would be numbers and a text object's row groups would fail
    mid-training. A category column (dictionary-encoded) counts as its values' type."""

    def kind(field: pa.Field) -> str:
        value = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
        return "text" if pa.types.is_string(value) or pa.types.is_large_string(value) else "number"

    if not schemas:
        return
    first, first_field = next((uri, schema.field(label)) for uri, schema in schemas.items())
    for uri, schema in schemas.items():
        if kind(schema.field(label)) != kind(first_field):
            raise DataError(
                f"{uri}: label {label!r} is {schema.field(label).type}, but {first_field.type} in {first}; "
                "make it one type in every object (numbers written as text in some?)"
            )


def _read_row_group(parquet: pq.ParquetFile, index: int, uri: str, columns: list[str] | None = None) -> pa.Table:
    """One row group, its pages' checksums verified where written (``_open``). Content that cannot be
    decoded or does not match its checksum is a ``DataError`` naming the object and row group; the
    sampler reads a row group that failed once more before failing the group (``StreamSampler._load``),
    as staging downloads a file again once."""
    try:
        return parquet.read_row_group(index, columns=columns)
    except (OSError, pa.ArrowInvalid) as exc:
        raise read_error(exc, uri, f"row group {index} cannot be read") from exc


# The AWS SDK's error names for a request that is wrong in itself: trying again will not help.
_PERMANENT: tuple[str, ...] = ("ACCESS_DENIED", "NO_SUCH_BUCKET", "NO_SUCH_KEY", "RESOURCE_NOT_FOUND")
_PERMANENT += ("INVALID_ACCESS_KEY_ID",)
_PERMANENT += ("SIGNATURE_DOES_NOT_MATCH", "HTTP status 401", "HTTP status 403", "HTTP status 404")


def read_error(exc: Exception, uri: str, what: str) -> DataError | StorageError:
    """pyarrow's error, named for the object: a request S3 refused or failed (the AWS SDK's text says
    "AWS Error") is a ``StorageError``, transient unless the request itself was wrong; anything else is
    the object's content (``DataError``)."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "AWS Error" in first:
        transient = not any(name in first for name in _PERMANENT)
        return StorageError(f"{uri}: {what}: S3 refused or failed the request ({first})", transient=transient)
    return DataError(f"{uri}: {what} ({first})")


class RowGroupSource:
    """Row groups of a streamed channel as arrays: from the local copy if read before (by this job, or by
    another that read the same objects with the same schema), else from S3.

    The last few objects read stay open with their footers, so the next row group of an object costs
    one ranged read, not a footer read first (a round trip each, 20-50 ms on S3).
    """

    OPEN_OBJECTS = 4
    EVICT_EVERY_BYTES = 256 << 20  # kept between looks at the cache's size (at most a 16th of the cap)

    def __init__(self, layout: list[dict], schema: dict, cache_dir: Path):
        self._objects = {o["id"]: o for o in layout}
        self._schema = datasets.Schema(schema["features"], schema["label"], schema["task"], schema["classes"])
        self._cache_dir = cache_dir
        self._fs: dict[str, pafs.S3FileSystem] = {}  # by bucket (arrow_filesystem)
        self._signer: tuple | None = None  # the credentials self._fs signs with
        self._files: OrderedDict[str, pq.ParquetFile] = OrderedDict()
        self._lock = threading.Lock()
        self._unevicted = 0  # bytes kept since the last look at the cache's size
        self._keeping = True  # False once the disk was found full
        cache_dir.mkdir(parents=True, exist_ok=True)

    def load(self, unit_id: str) -> tuple[np.ndarray, np.ndarray]:
        """``unit_id`` is ``<s3 uri>#rg<i>``."""
        uri, _, index = unit_id.rpartition("#rg")
        local = kept_rowgroups.path(self._cache_dir, unit_id, self._objects[uri].get("etag", ""), self._schema)
        try:
            arrays = kept_rowgroups.load(local)
            os.utime(local)  # recency, for eviction
            return arrays
        except FileNotFoundError:
            pass  # not read yet, or evicted
        except ValueError as exc:
            # cut short or not .npy (a machine that lost power after the rename, a disk error): read it again
            log.warning("kept row group %s is damaged (%s): reading it from S3 again", local.name, exc)
            cache.unlink_unmapped(local)  # (another node may have mapped a new copy under the name meanwhile)
        columns = [*self._schema.features, self._schema.label]
        with self._lock:  # one reader at a time per open object
            table = _read_row_group(self._parquet(uri), int(index), uri, columns)
        x, y = datasets.to_arrays(table, self._schema, f"{uri} row group {index}")
        if self._keeping and kept_rowgroups.save(local, x, y):
            self._unevicted += x.nbytes + y.nbytes
        else:
            self._keeping = False  # the disk is full: stop trying (each try writes until it fails)
        # Kept under the cache's size cap, least recently used first: a channel larger than the disk still
        # streams (an evicted row group is read from S3 again), but not one whose arrays a group has mapped (they
        # hold a lock on it: on an NFS cache its removal would kill that group, see ``cache.evict``). A look stats
        # every file of the cache under its lock, so it waits for a 16th of the cap to be written.
        if self._unevicted > min(self.EVICT_EVERY_BYTES, cache.max_bytes() // 16):
            self._unevicted = 0
            cache.evict(keep={str(local)})
        return x, y

    def _parquet(self, uri: str) -> pq.ParquetFile:
        frozen = s3.credentials()
        signer = (frozen.access_key, frozen.token) if frozen else None
        if signer != self._signer:
            # Credentials that expire (an assumed role, an instance profile) were refreshed since the
            # file system was made with them: a new one signs with the new ones.
            self._fs, self._signer = {}, signer
            self._files.clear()
        if uri not in self._files:
            bucket = uri[5:].partition("/")[0]
            if bucket not in self._fs:
                self._fs[bucket] = arrow_filesystem(bucket)
            parquet, size, etag = _open(self._fs[bucket], uri[5:])
            _check_unchanged(parquet, size, etag, self._objects[uri], "staged")
            self._files[uri] = parquet
            while len(self._files) > self.OPEN_OBJECTS:
                self._files.popitem(last=False)
        self._files.move_to_end(uri)
        return self._files[uri]


def _check_unchanged(parquet: pq.ParquetFile, size: int, etag: str, staged: dict, when: str) -> None:
    """Fail, naming the object, when it is not the version the channel was ``when`` ("listed" or
    "staged") with: rows would otherwise be lost, doubled or taken from another version without a word.

    pyarrow's reads cannot be made conditional on the ETag, so the ETag is compared when the object is
    opened (as is its size, and, once described, its row groups); an object replaced between that and a
    later range read of it is not caught. Changed since listing (seconds ago, while staging) is transient,
    as staging's own check is: the task's retry lists it again. Changed since staging is the data's."""
    counts = _row_counts(parquet)
    replaced = etag and staged.get("etag") and etag != staged["etag"]
    if replaced or size != staged.get("size", size) or counts != staged.get("row_groups", counts):
        then = f"{staged.get('size')} bytes" + (
            f" in row groups of {staged['row_groups']} rows" if "row_groups" in staged else ""
        )
        message = (
            f"{staged['id']}: changed since the channel was {when} (now ETag {etag or '?'}, {size} bytes in row "
            f"groups of {counts} rows; then ETag {staged.get('etag') or '?'}, {then}); stage the channel again"
        )
        raise StorageError(message, transient=True) if when == "listed" else DataError(message)


def _opened(manifest: ChannelManifest, filesystem) -> Iterator[tuple[StagedObject, tuple[pq.ParquetFile, int, str]]]:
    """Each object of the channel with ``_open``'s answer, in order, ``MAX_CONCURRENT_OBJECTS`` opened at a time under a
    progress bar: each is a HEAD and a footer read, and one after another, 10,000 objects at S3's round trips
    took minutes with nothing shown. At most twice that many are open at once."""
    objects = manifest.objects
    with progress.bar(f"reading the footers of {manifest.name}", len(objects)) as advance:
        opened = parallel.in_threads(
            lambda obj: _open(filesystem(obj.bucket), f"{obj.bucket}/{obj.key}", listed=True),
            objects,
            MAX_CONCURRENT_OBJECTS,
        )
        for obj, opening in zip(objects, opened, strict=True):
            yield obj, opening
            advance(1)


def _open(filesystem: pafs.S3FileSystem, path: str, listed: bool = False) -> tuple[pq.ParquetFile, int, str]:
    """The object ``bucket/key`` as a parquet file (its footer read), its size in bytes and its ETag
    (unquoted; ``""`` where the endpoint sent none), from the HEAD pyarrow makes to open it. ``listed``: opened
    while staging, seconds after the listing (an object gone since is transient, as ``_check_unchanged``'s)."""
    # pre_buffer: a row group's column chunks are fetched as concurrent, coalesced range reads rather than one after
    # another (an 18 MB row group from a local endpoint: 55 ms -> 36 ms; more where each waits on a round trip).
    try:
        source = filesystem.open_input_file(path)
        etag = (source.metadata().get("ETag") or b"").decode(errors="replace").strip('"')
        # page_checksum_verification: the pages' CRCs, where the writer wrote them (parquet-mr and Spark
        # do by default; pyarrow with write_page_checksum=True), are checked as each page is read.
        parquet = pq.ParquetFile(source, pre_buffer=True, page_checksum_verification=True)
        return parquet, source.size(), etag
    except FileNotFoundError as exc:  # pyarrow's word for S3's 404
        if listed:  # the stage's retry lists the channel again, without it (staging's own rule for a deleted one)
            raise StorageError(
                f"s3://{path}: deleted from S3 while it was being staged; run the job again", True
            ) from exc
        raise StorageError(
            f"s3://{path}: no longer in S3 (deleted or renamed since the channel was staged); restore it, "
            "or run the job again to stage the channel as it is now"
        ) from exc
    except (OSError, pa.ArrowInvalid) as exc:
        raise read_error(exc, f"s3://{path}", "cannot be read as parquet") from exc


def _row_counts(parquet: pq.ParquetFile) -> list[int]:
    return [parquet.metadata.row_group(i).num_rows for i in range(parquet.metadata.num_row_groups)]


def units(layout: list[dict]) -> list[tuple[str, int, int]]:
    """Every row group of the channel as a sharding unit."""
    return sharding.row_group_units(layout)
