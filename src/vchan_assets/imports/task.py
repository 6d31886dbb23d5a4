"""The work of one import task (Milvus' ImportV2 task): one file or a slice of a
Parquet file's row groups in, segments of binlogs out (pure pyarrow).

Runs inside a Spark Python worker (or in-process for the local engine). Rows are read
batch by batch, converted to the collection's fields (`files.convert`), given row ids
from the task's allocated range and the job's one timestamp, routed as the producer routes
inserts: to vchannels by `fields.vchannel_index` of the pk and, in a collection with a
partition key, to the hidden partition its key hashes to; and buffered per (partition,
vchannel). A buffer is written out as soon as the buffers together pass `buffer_bytes`
(memory stays flat in rows): insert binlogs per column group and a stats log, the layout
of a sync. A segment is closed at `max_rows` and the next one of the task's reserved ids
opened. An upsert writes a delete of every imported pk into an L0 segment of each target
partition (with a partition key, a row's older version may be in any of them).

Returns the segments as SegmentInfos in state Importing (invisible); nothing here
touches etcd.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from vchan_assets.datanode.binlog_writer import SCALAR_GROUP, column_groups, group_field_ids, write_parquet
from vchan_assets.datanode.stats import PkStats
from vchan_assets.fields import vchannel_index
from vchan_assets.imports.files import FileSource, ImportInputError, convert, read_batches
from vchan_assets.imports.jobs import ImportFormat
from vchan_assets.model import (
    Binlog,
    CollectionSchema,
    ColumnGroupBinlogs,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
)
from vchan_assets.storage import Storage, StorageError
from vchan_assets.storage.layout import delta_log_key, insert_log_key, stats_log_key


@dataclass(frozen=True)
class ImportSpec:
    """Everything one task needs; picklable, shipped to the Spark worker."""

    job_id: int
    task: int
    source: FileSource
    path: str
    format: ImportFormat
    row_groups: tuple[int, ...] | None  # Parquet slice; None: the whole file
    storage: Storage
    schema: CollectionSchema
    collection_id: int
    partition_id: int
    vchannels: tuple[str, ...]
    timestamp: int
    row_id_base: int  # row ids -row_id_base .. -(row_id_base + rows - 1)
    segment_ids: tuple[int, ...]  # reserved for this task, used in order
    log_id_base: int
    log_id_count: int
    max_rows: int
    buffer_bytes: int = 128 << 20
    # Upsert: per target partition, the L0 segment that gets a delete of every imported pk.
    upsert_segments: tuple[int, ...] = ()
    # A collection with a partition key: its field, and the hidden partitions its hash picks
    # from (`partition_id` is then unused).
    partition_key: str | None = None
    key_partitions: tuple[int, ...] = ()

    @property
    def partitions(self) -> tuple[int, ...]:
        """The partitions the task's rows go to."""
        return self.key_partitions or (self.partition_id,)


_SYSTEM = (pa.field("offset", pa.int64(), nullable=False), pa.field("timestamp", pa.int64(), nullable=False))


@dataclass
class _Open:
    """The segment a vchannel's rows currently go to, and its buffered rows."""

    segment: SegmentInfo
    tables: list[pa.Table] = field(default_factory=list)
    nbytes: int = 0
    buffered_rows: int = 0


class ImportTaskError(RuntimeError):
    """The task ran out of the ids reserved for it (a bug or a limit, not bad input)."""


class ImportTask:
    def __init__(self, spec: ImportSpec) -> None:
        self.spec = spec
        self.groups = column_groups(spec.schema)
        self.group_fields = group_field_ids(spec.schema)
        self.pk = spec.schema.primary.name
        self.next_row_id = spec.row_id_base
        self.segment_ids = iter(spec.segment_ids)
        self.log_ids = iter(range(spec.log_id_base, spec.log_id_base + spec.log_id_count))
        self.open: dict[tuple[int, int], _Open] = {}  # (partition id, vchannel index) -> open segment
        self.done: list[SegmentInfo] = []
        self.deletes: dict[int, SegmentInfo] = {}  # upsert: partition id -> L0 segment of its deletes

    def run(self) -> list[SegmentInfo]:
        rows = 0
        spec = self.spec
        for batch in read_batches(spec.source, spec.path, spec.format, row_groups=spec.row_groups):
            self._add(convert(spec.schema, batch, spec.path, rows))
            rows += batch.num_rows
        for slot in list(self.open):
            self._close(slot)
        return self.done + list(self.deletes.values())

    def _add(self, table: pa.Table) -> None:
        n = table.num_rows
        # Row ids from the ID allocator, negated: a synced row's row_id is its log offset
        # (>= 0), so log checks tell imported rows apart even after a compaction merged them.
        ids = pa.array(-np.arange(self.next_row_id, self.next_row_id + n, dtype=np.int64))
        self.next_row_id += n
        # Not nullable, as in the log: binlogs of imports and syncs share one schema.
        ts = pa.array(np.full(n, self.spec.timestamp, dtype=np.int64))
        table = table.add_column(0, _SYSTEM[0], ids).add_column(1, _SYSTEM[1], ts)
        k, partitions = len(self.spec.vchannels), self.spec.partitions
        slot = vchannel_index(table[self.pk], k) if k > 1 else np.zeros(n, dtype=np.int64)
        if self.spec.partition_key is not None:
            slot += k * vchannel_index(table[self.spec.partition_key], len(partitions))
        slots = np.unique(slot).tolist()
        for s in slots:
            rows = table.filter(pa.array(slot == s)) if len(slots) > 1 else table
            self._buffer((partitions[s // k], s % k), rows)

    def _buffer(self, slot: tuple[int, int], rows: pa.Table) -> None:
        while rows.num_rows:
            seg = self._segment(slot)
            room = self.spec.max_rows - seg.segment.num_rows - seg.buffered_rows
            part = rows.slice(0, room)
            rows = rows.slice(room)
            seg.tables.append(part)
            seg.nbytes += part.nbytes
            seg.buffered_rows += part.num_rows
            if seg.segment.num_rows + seg.buffered_rows >= self.spec.max_rows:
                self._close(slot)
        while sum(s.nbytes for s in self.open.values()) > self.spec.buffer_bytes:
            self._write(max(self.open.values(), key=lambda s: s.nbytes))

    def _segment(self, slot: tuple[int, int]) -> _Open:
        if slot not in self.open:
            seg_id = next(self.segment_ids, None)
            if seg_id is None:
                raise ImportTaskError(f"import task {self.spec.task} used every segment id reserved for it")
            partition, channel = slot
            self.open[slot] = _Open(
                self._new_segment(
                    seg_id,
                    self.spec.vchannels[channel],
                    partition,
                    max_rows=self.spec.max_rows,
                    last_flush_ts=self.spec.timestamp,
                )
            )
        return self.open[slot]

    def _new_segment(self, seg_id: int, vchannel: str, partition_id: int, **fields: Any) -> SegmentInfo:
        """A segment this task writes: Importing (invisible until the job commits), in the
        job's collection and `partition_id`, created now."""
        return SegmentInfo(
            id=seg_id,
            collection_id=self.spec.collection_id,
            partition_id=partition_id,
            vchannel=vchannel,
            state=SegmentState.IMPORTING,
            created_at=time.time(),
            import_job=self.spec.job_id,
            **fields,
        )

    def _close(self, slot: tuple[int, int]) -> None:
        seg = self.open.pop(slot)
        self._write(seg)
        if seg.segment.num_rows:
            self.done.append(seg.segment)

    def _write(self, seg: _Open) -> None:
        """Buffered rows out as one binlog per column group plus a stats log."""
        if not seg.tables:
            return
        rows = pa.concat_tables(seg.tables)
        seg.tables, seg.nbytes, seg.buffered_rows = [], 0, 0
        info = seg.segment
        ts = self.spec.timestamp
        groups = {g.group: g for g in info.binlogs}
        for group, columns in self.groups:
            log_id = self._log_id()
            key = insert_log_key(info.collection_id, info.partition_id, info.id, group, log_id)
            table = rows.select(columns).rename_columns(["row_id", *columns[1:]])
            size = write_parquet(self.spec.storage, key, table, vector=group != SCALAR_GROUP)
            old = groups.get(group)
            logs = (*(old.logs if old else ()), Binlog(log_id, key, rows.num_rows, ts, ts, size))
            groups[group] = ColumnGroupBinlogs(group, self.group_fields[group], logs)
        log_id = self._log_id()
        key = stats_log_key(info.collection_id, info.partition_id, info.id, log_id)
        payload = PkStats.build(rows[self.pk]).to_bytes()
        self.spec.storage.write_atomic(key, payload)
        seg.segment = info.with_changes(
            binlogs=tuple(groups[g] for g in sorted(groups)),
            statslogs=(*info.statslogs, Binlog(log_id, key, rows.num_rows, ts, ts, len(payload))),
            num_rows=info.num_rows + rows.num_rows,
        )
        if self.spec.upsert_segments:
            self._write_deletes(info, rows)

    def _write_deletes(self, written: SegmentInfo, rows: pa.Table) -> None:
        """Upsert (as Milvus): a delete of each imported pk at the job's timestamp, in each
        target partition. A delete removes the rows of its pk with an older timestamp, so
        the rows already in the collection go and the imported ones (same timestamp) stay."""
        table = pa.table({"pk": rows[self.pk], "timestamp": rows["timestamp"], "offset": rows["offset"]})
        ts = self.spec.timestamp
        for partition, seg_id in zip(self.spec.partitions, self.spec.upsert_segments, strict=True):
            l0 = self.deletes.get(partition) or self._new_segment(
                seg_id, written.vchannel, partition, level=SegmentLevel.L0
            )
            log_id = self._log_id()
            key = delta_log_key(l0.collection_id, l0.partition_id, l0.id, log_id)
            size = write_parquet(self.spec.storage, key, table, vector=False)
            self.deletes[partition] = l0.with_changes(
                deltalogs=(*l0.deltalogs, Binlog(log_id, key, rows.num_rows, ts, ts, size)),
                num_rows=l0.num_rows + rows.num_rows,
            )

    def _log_id(self) -> int:
        log_id = next(self.log_ids, None)
        if log_id is None:
            raise ImportTaskError(f"import task {self.spec.task} used every log id reserved for it")
        return log_id


def run_import_task(spec: ImportSpec) -> list[SegmentInfo]:
    return ImportTask(spec).run()


# --- running tasks on Spark ---------------------------------------------------------------------

RESULT_SCHEMA = pa.schema([("task", pa.int64()), ("result", pa.binary())])

TaskResult = list[SegmentInfo] | ImportInputError | StorageError


def run_pickled(spec: ImportSpec) -> dict[str, object]:
    """One task's segments, or the typed error of a bad input (pickled either way)."""
    try:
        result: object = run_import_task(spec)
    except (ImportInputError, StorageError) as exc:
        result = exc
    return {"task": spec.task, "result": pickle.dumps(result)}


def run_tasks_arrow(specs: list[ImportSpec], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the input holds task indices; one result row per task."""
    for batch in batches:
        for index in batch.column(0).to_pylist():
            yield pa.RecordBatch.from_pylist([run_pickled(specs[int(index)])], schema=RESULT_SCHEMA)


def outcome_of(row: dict[str, object]) -> TaskResult:
    raw = row["result"]
    assert isinstance(raw, bytes)
    found = pickle.loads(raw)
    assert isinstance(found, list | ImportInputError | StorageError)
    return found
