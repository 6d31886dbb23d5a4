"""The work of one import task (Milvus' ImportV2 task): one file or a slice of a
Parquet file's row groups in, segments of binlogs out (pure pyarrow).

Runs inside a Spark Python worker (or in-process for the local engine). Rows are read
batch by batch, converted to the collection's fields (`files.convert`), given row ids
from the task's allocated range and the job's one timestamp, routed to vchannels by
`pk % K` (as the producer routes inserts), and buffered per vchannel. A buffer is written
out as soon as the buffers together pass `buffer_bytes` (memory stays flat in rows):
insert binlogs per column group and a stats log, the layout of a sync. A vchannel's
segment is closed at `max_rows` and the next one of the task's reserved ids opened.

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
    upsert_segment: int = 0  # upsert: the L0 segment that gets a delete of every imported pk


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
        self.open: dict[int, _Open] = {}  # vchannel index -> open segment
        self.done: list[SegmentInfo] = []
        self.deletes: SegmentInfo | None = None  # upsert: the L0 segment of this task's deletes

    def run(self) -> list[SegmentInfo]:
        rows = 0
        spec = self.spec
        for batch in read_batches(spec.source, spec.path, spec.format, row_groups=spec.row_groups):
            self._add(convert(spec.schema, batch, spec.path, rows))
            rows += batch.num_rows
        for channel in list(self.open):
            self._close(channel)
        return self.done + ([self.deletes] if self.deletes else [])

    def _add(self, table: pa.Table) -> None:
        n = table.num_rows
        # Row ids from the ID allocator, negated: a synced row's row_id is its log offset
        # (>= 0), so log checks tell imported rows apart even after a compaction merged them.
        ids = pa.array(-np.arange(self.next_row_id, self.next_row_id + n, dtype=np.int64))
        self.next_row_id += n
        # Not nullable, as in the log: binlogs of imports and syncs share one schema.
        ts = pa.array(np.full(n, self.spec.timestamp, dtype=np.int64))
        table = table.add_column(0, _SYSTEM[0], ids).add_column(1, _SYSTEM[1], ts)
        k = len(self.spec.vchannels)
        channel = vchannel_index(table[self.pk], k) if k > 1 else np.zeros(n, dtype=np.int64)
        for c in np.unique(channel).tolist():
            rows = table.filter(pa.array(channel == c)) if k > 1 else table
            self._buffer(int(c), rows)

    def _buffer(self, channel: int, rows: pa.Table) -> None:
        while rows.num_rows:
            seg = self._segment(channel)
            room = self.spec.max_rows - seg.segment.num_rows - seg.buffered_rows
            part = rows.slice(0, room)
            rows = rows.slice(room)
            seg.tables.append(part)
            seg.nbytes += part.nbytes
            seg.buffered_rows += part.num_rows
            if seg.segment.num_rows + seg.buffered_rows >= self.spec.max_rows:
                self._close(channel)
        while sum(s.nbytes for s in self.open.values()) > self.spec.buffer_bytes:
            self._write(max(self.open.values(), key=lambda s: s.nbytes))

    def _segment(self, channel: int) -> _Open:
        if channel not in self.open:
            seg_id = next(self.segment_ids, None)
            if seg_id is None:
                raise ImportTaskError(f"import task {self.spec.task} used every segment id reserved for it")
            vchannel = self.spec.vchannels[channel]
            self.open[channel] = _Open(
                self._new_segment(
                    seg_id, vchannel, max_rows=self.spec.max_rows, last_flush_ts=self.spec.timestamp
                )
            )
        return self.open[channel]

    def _new_segment(self, seg_id: int, vchannel: str, **fields: Any) -> SegmentInfo:
        """A segment this task writes: Importing (invisible until the job commits), in the
        job's collection and partition, created now."""
        return SegmentInfo(
            id=seg_id,
            collection_id=self.spec.collection_id,
            partition_id=self.spec.partition_id,
            vchannel=vchannel,
            state=SegmentState.IMPORTING,
            created_at=time.time(),
            import_job=self.spec.job_id,
            **fields,
        )

    def _close(self, channel: int) -> None:
        seg = self.open.pop(channel)
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
        payload = PkStats.build(rows[self.pk].to_numpy()).to_bytes()
        self.spec.storage.write_atomic(key, payload)
        seg.segment = info.with_changes(
            binlogs=tuple(groups[g] for g in sorted(groups)),
            statslogs=(*info.statslogs, Binlog(log_id, key, rows.num_rows, ts, ts, len(payload))),
            num_rows=info.num_rows + rows.num_rows,
        )
        if self.spec.upsert_segment:
            self._write_deletes(info, rows)

    def _write_deletes(self, written: SegmentInfo, rows: pa.Table) -> None:
        """Upsert (as Milvus): a delete of each imported pk at the job's timestamp. A delete
        removes the rows of its pk with an older timestamp, so the rows already in the
        collection go and the imported ones (same timestamp) stay."""
        l0 = self.deletes or self._new_segment(
            self.spec.upsert_segment, written.vchannel, level=SegmentLevel.L0
        )
        log_id = self._log_id()
        key = delta_log_key(l0.collection_id, l0.partition_id, l0.id, log_id)
        table = pa.table({"pk": rows[self.pk], "timestamp": rows["timestamp"], "offset": rows["offset"]})
        size = write_parquet(self.spec.storage, key, table, vector=False)
        ts = self.spec.timestamp
        self.deletes = l0.with_changes(
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
