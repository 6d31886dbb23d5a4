"""The work of one sync task: log files in, binlog files out (pure pyarrow).

Runs inside a Spark Python worker (or in-process for the local engine). It reads
its share of the log range file by file, drops rows already persisted (at or below
each segment's dml_position: replay after a crash), and writes:
  - insert binlogs per segment and column group (storage v2: the scalar and system
    fields together, each vector field in its own group, every group with row_id);
  - a stats log per insert binlog: pk min/max and a bloom filter;
  - delta logs (pk, timestamp) per partition, into that partition's L0 segment.
Memory is bounded by `buffer_bytes`, not by the number of rows: a segment's buffer
is written out as soon as the buffers together pass the budget.
Returns one `WrittenFile` per file; nothing here touches etcd.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.datanode.stats import PkStats
from vchan_assets.failpoints import failpoint
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage, StorageError
from vchan_assets.storage.layout import delta_log_key, insert_log_key, stats_log_key
from vchan_assets.wal.format import LogError, MsgType
from vchan_assets.wal.reader import read_log_file


class FileKind(enum.StrEnum):
    INSERT = "insert"
    DELTA = "delta"
    STATS = "stats"


INSERT, DELTA, STATS = FileKind.INSERT, FileKind.DELTA, FileKind.STATS
SCALAR_GROUP = 0


@dataclass(frozen=True)
class TaskSpec:
    """Everything one task needs; picklable, shipped to the Spark worker."""

    task: int
    storage: Storage
    collection_id: int
    vchannel: str
    schema: dict[str, Any]  # CollectionSchema.to_dict()
    file_keys: tuple[str, ...]
    after_offset: int  # exclusive
    up_to_offset: int  # inclusive
    insert_floor: dict[int, int]  # segment -> offset already persisted (dml_position)
    delete_floor: dict[int, int]  # partition -> offset of deletes already persisted
    l0_segments: dict[int, int]  # partition -> L0 segment for this sync's deletes
    id_base: int
    id_count: int
    buffer_bytes: int = 256 << 20


@dataclass(frozen=True)
class WrittenFile:
    kind: FileKind
    segment_id: int
    partition_id: int
    group: int  # column group of insert binlogs; -1 otherwise
    log_id: int
    key: str
    entries: int
    ts_from: int
    ts_to: int
    size_bytes: int
    min_offset: int
    min_offset_ts: int
    max_offset: int
    max_offset_ts: int


RESULT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("segment_id", pa.int64()),
        ("partition_id", pa.int64()),
        ("group", pa.int64()),
        ("log_id", pa.int64()),
        ("key", pa.string()),
        ("entries", pa.int64()),
        ("ts_from", pa.int64()),
        ("ts_to", pa.int64()),
        ("size_bytes", pa.int64()),
        ("min_offset", pa.int64()),
        ("min_offset_ts", pa.int64()),
        ("max_offset", pa.int64()),
        ("max_offset_ts", pa.int64()),
        ("error", pa.binary()),  # a pickled typed error (LogError, StorageError) instead of a file
    ]
)


def column_groups(schema: CollectionSchema) -> list[tuple[int, list[str]]]:
    """(group id, log columns) of each column group: group 0 holds row_id, timestamp,
    pk and the scalars; each vector field is its own group (with row_id to align)."""
    scalars = [f.name for f in [schema.primary, *(f for f in schema.scalar_fields if not f.is_primary)]]
    groups = [(SCALAR_GROUP, ["offset", "timestamp", *scalars])]
    groups += [(f.field_id, ["offset", f.name]) for f in schema.vector_fields]
    return groups


def group_field_ids(schema: CollectionSchema) -> dict[int, tuple[int, ...]]:
    """Field IDs stored in each column group (0 = row id, 1 = timestamp, as in Milvus)."""
    out: dict[int, tuple[int, ...]] = {
        SCALAR_GROUP: (0, 1, *(f.field_id for f in schema.fields if not f.is_vector))
    }
    for f in schema.vector_fields:
        out[f.field_id] = (0, f.field_id)
    return out


class LogIdsExhaustedError(RuntimeError):
    """A sync task wrote more files than the log ids allocated to it (a bug or a limit)."""


class _Ids:
    def __init__(self, base: int, count: int) -> None:
        self.start = self.next = base
        self.end = base + count

    def take(self) -> int:
        if self.next >= self.end:
            raise LogIdsExhaustedError(f"sync task used all {self.end - self.start} log ids allocated to it")
        self.next += 1
        return self.next - 1


def _unpersisted(
    table: pa.Table, kind: MsgType, by: str, floors: dict[int, int]
) -> Iterator[tuple[int, pa.Table]]:
    """The rows of message type `kind` per value of column `by` (a segment or partition
    id; null: -1), without those at or below that value's floor offset: persisted by an
    earlier sync (replay after a crash). Values with no rows left are skipped."""
    matches = pc.equal(table["msg_type"], kind.value).to_numpy(zero_copy_only=False)
    if not matches.any():
        return
    offsets = table["offset"].to_numpy()
    values = table[by].fill_null(-1).to_numpy()
    for value in np.unique(values[matches]).tolist():
        mask = matches & (values == value)
        floor = floors.get(value)
        if floor is not None:
            mask &= offsets > floor
        rows = take_rows(table, mask)
        if rows.num_rows:
            yield value, rows


@dataclass
class _Buffer:
    segment_id: int
    partition_id: int
    tables: list[pa.Table] = field(default_factory=list)
    nbytes: int = 0


class TaskWriter:
    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.schema = CollectionSchema.from_dict(spec.schema)
        self.groups = column_groups(self.schema)
        self.pk = self.schema.primary.name
        self.ids = _Ids(spec.id_base, spec.id_count)
        self.buffers: dict[int, _Buffer] = {}
        self.deletes: dict[int, list[pa.Table]] = {}
        self.written: list[WrittenFile] = []

    def run(self) -> list[WrittenFile]:
        # A task is one core's share of the sync (Spark runs one task per core, the
        # in-process path one thread per task): reads decode on the task's own thread, as
        # pyarrow's pool on top of that oversubscribes the cores (BENCHMARKS.md, "Sync").
        for key in self.spec.file_keys:
            self._consume(read_log_file(self.spec.storage, key, self.schema, use_threads=False))
        for seg in list(self.buffers):
            self._flush_segment(seg)
        for partition, tables in self.deletes.items():
            self._write_deltas(partition, pa.concat_tables(tables))
        # Files are written without waiting for the disk (its write-back overlaps the
        # task's next reads and encodes), then made durable together here: before the
        # task reports them, so before any segment meta can refer to them.
        self.spec.storage.make_durable(w.key for w in self.written)
        return self.written

    def _consume(self, table: pa.Table) -> None:
        # Offsets are dense and sorted (the reader checked): the range is a slice.
        first = table["offset"][0].as_py() if table.num_rows else 0
        start = max(0, self.spec.after_offset + 1 - first)
        stop = min(table.num_rows, self.spec.up_to_offset + 1 - first)
        if stop <= start:
            return
        table = table.slice(start, stop - start)
        for seg, rows in _unpersisted(table, MsgType.INSERT, "segment_id", self.spec.insert_floor):
            self._buffer_insert(seg, rows)
        for partition, rows in _unpersisted(table, MsgType.DELETE, "partition_id", self.spec.delete_floor):
            self.deletes.setdefault(partition, []).append(rows.select(["offset", "timestamp", self.pk]))

    def _buffer_insert(self, seg: int, rows: pa.Table) -> None:
        buf = self.buffers.get(seg)
        if buf is None:
            buf = self.buffers[seg] = _Buffer(seg, rows["partition_id"][0].as_py())
        buf.tables.append(rows)
        buf.nbytes += rows.nbytes
        while sum(b.nbytes for b in self.buffers.values()) > self.spec.buffer_bytes:
            self._flush_segment(max(self.buffers.values(), key=lambda b: b.nbytes).segment_id)

    def _flush_segment(self, seg: int) -> None:
        buf = self.buffers.pop(seg)
        rows = pa.concat_tables(buf.tables)
        coll, part = self.spec.collection_id, buf.partition_id
        span = _span(rows)
        for group, columns in self.groups:
            log_id = self.ids.take()
            part_table = rows.select(columns).rename_columns(["row_id", *columns[1:]])
            key = insert_log_key(coll, part, seg, group, log_id)
            size = self._write_parquet(key, part_table, vector=group != SCALAR_GROUP)
            self.written.append(
                WrittenFile(INSERT, seg, part, group, log_id, key, rows.num_rows, *span[:2], size, *span[2:])
            )
        pks = rows[self.pk]  # Arrow: VarChar keys are hashed from its buffers
        log_id = self.ids.take()
        key = stats_log_key(coll, part, seg, log_id)
        payload = PkStats.build(pks).to_bytes()
        self.spec.storage.write_atomic(key, payload, durable=False)
        self.written.append(
            WrittenFile(STATS, seg, part, -1, log_id, key, rows.num_rows, *span[:2], len(payload), *span[2:])
        )

    def _write_deltas(self, partition: int, rows: pa.Table) -> None:
        seg = self.spec.l0_segments[partition]
        log_id = self.ids.take()
        key = delta_log_key(self.spec.collection_id, partition, seg, log_id)
        table = pa.table({"pk": rows[self.pk], "timestamp": rows["timestamp"], "offset": rows["offset"]})
        size = self._write_parquet(key, table, vector=False)
        span = _span(rows)
        self.written.append(
            WrittenFile(DELTA, seg, partition, -1, log_id, key, rows.num_rows, *span[:2], size, *span[2:])
        )

    def _write_parquet(self, key: str, table: pa.Table, vector: bool) -> int:
        return write_parquet(self.spec.storage, key, table, vector, durable=False)


# The rows a string column's values are sampled from to tell keys (ids, URLs: every value
# different) from values that repeat.
DICTIONARY_SAMPLE = 1000


def parquet_options(table: pa.Table, vector: bool) -> dict[str, Any]:
    """Parquet writer settings of a binlog (each measured by `python -m bench.parquet_settings`,
    BENCHMARKS.md). Random vectors do not compress, and dictionary encoding and statistics
    only cost time on them. In the scalar group only strings that repeat get a dictionary:
    row ids, timestamps and primary keys (a VarChar key too) are unique, so a dictionary
    there is built, overflows and is thrown away (a slower write and a larger file). A
    string column whose first DICTIONARY_SAMPLE values all differ is taken for keys."""
    if vector:
        return {"compression": "none", "use_dictionary": False, "write_statistics": False}
    repeating = [
        f.name
        for f in table.schema
        if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type)) and _repeats(table[f.name])
    ]
    return {"compression": "snappy", "use_dictionary": repeating, "write_statistics": True}


def _repeats(column: pa.ChunkedArray) -> bool:
    sample = column.slice(0, DICTIONARY_SAMPLE)
    return pc.count_distinct(sample, mode="all").as_py() < len(sample)


def write_parquet(storage: Storage, key: str, table: pa.Table, vector: bool, durable: bool = True) -> int:
    """Write a binlog as Parquet straight into storage (atomically; `durable` as in
    `Storage.write_atomic`); returns its size."""
    return storage.write_parquet(key, table, durable=durable, **parquet_options(table, vector))


def take_rows(table: pa.Table, mask: np.ndarray) -> pa.Table:
    """The rows where `mask` is true; a zero-copy slice when they form one run, which is
    the common case (a producer batch is one segment's rows followed by a time tick)."""
    index = np.flatnonzero(mask)
    if len(index) == 0:
        return table.slice(0, 0)
    if index[-1] - index[0] + 1 == len(index):
        return table.slice(int(index[0]), len(index))
    return table.take(pa.array(index))


def _span(rows: pa.Table) -> tuple[int, int, int, int, int, int]:
    """(ts_from, ts_to, min_offset, min_offset_ts, max_offset, max_offset_ts); rows are in log order."""
    ts = rows["timestamp"].to_numpy()
    offsets = rows["offset"].to_numpy()
    return int(ts.min()), int(ts.max()), int(offsets[0]), int(ts[0]), int(offsets[-1]), int(ts[-1])


def run_task(spec: TaskSpec) -> list[WrittenFile]:
    written = TaskWriter(spec).run()
    failpoint("task_written")
    return written


def run_tasks_in_process(specs: list[TaskSpec]) -> list[WrittenFile]:
    """The tasks in this process, one thread each: pyarrow reads, verifies, encodes and
    writes with the GIL released, so the threads use the cores as Spark's tasks would."""
    if len(specs) == 1:
        return run_task(specs[0])
    with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="sync-task") as pool:
        return [w for written in pool.map(run_task, specs) for w in written]


def run_tasks(
    specs: list[TaskSpec], indices: Iterable[int]
) -> Iterator[WrittenFile | LogError | StorageError]:
    """RDD body: the files each task wrote, or its typed error (a corrupt log file, a
    schema mismatch, unreadable storage), which the driver raises with its path
    (`written_or_raise`) instead of a generic Spark task failure."""
    for index in indices:
        try:
            yield from run_task(specs[index])
        except (LogError, StorageError) as exc:
            yield exc


def written_or_raise(outcomes: list[WrittenFile | LogError | StorageError]) -> list[WrittenFile]:
    """The files of `run_tasks`, or its first task's typed error raised."""
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return [o for o in outcomes if isinstance(o, WrittenFile)]


def run_tasks_arrow(specs: list[TaskSpec], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the input holds task indices; yields one batch of WrittenFile rows.

    A bad input (corrupt log file, schema mismatch, unreadable storage) comes back as
    a row carrying the pickled typed error, so the driver raises the same error type
    with its path instead of a generic Spark task failure."""
    for batch in batches:
        for task in batch.column(0).to_pylist():
            try:
                rows = [{**asdict(w), "error": None} for w in run_task(specs[int(task)])]
            except (LogError, StorageError) as exc:
                rows = [{**_EMPTY_ROW, "error": pickle.dumps(exc)}]
            yield pa.RecordBatch.from_pylist(rows, schema=RESULT_SCHEMA)


_EMPTY_ROW: dict[str, Any] = {name: None for name in RESULT_SCHEMA.names}


def from_record(row: dict[str, Any]) -> WrittenFile:
    """A result row back into a WrittenFile; re-raises a task's typed error."""
    if row.get("error") is not None:
        raise pickle.loads(row["error"])
    values = {k: row[k] for k in WrittenFile.__dataclass_fields__}
    return WrittenFile(**{**values, "kind": FileKind(values["kind"])})
