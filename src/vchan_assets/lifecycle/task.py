"""The work of one compaction plan: input binlogs in, sorted output segments out (pure pyarrow).

Runs inside a Spark Python worker (or in-process for the local engine), like the sync
task. It reads every input segment's column groups, removes the rows a delete of the
partition removes (a delete removes the rows of its pk with an older timestamp), sorts
by (pk, timestamp), cuts the result into segments of at most `max_rows`, and writes
per output: insert binlogs per column group and one stats log (pk min/max + bloom
filter). Returns the output SegmentInfos (Flushed, sorted, `compaction_from` = inputs);
nothing here touches etcd.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from vchan_assets.datanode.binlog_writer import SCALAR_GROUP, column_groups, group_field_ids, write_parquet
from vchan_assets.datanode.stats import PkStats
from vchan_assets.errors import DeclaredError
from vchan_assets.model import (
    Binlog,
    CollectionSchema,
    ColumnGroupBinlogs,
    MsgPosition,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
)
from vchan_assets.storage import Storage, StorageError
from vchan_assets.storage.layout import delta_log_key, insert_log_key, stats_log_key
from vchan_assets.storage.rows import (
    apply_deletes_to,
    empty_deletes,
    read_deletes,
    read_files,
    segment_rows,
    unexpired,
)


class CompactionInputError(DeclaredError, ValueError):
    """An input binlog cannot be read: the plan fails naming the file; inputs stay live."""

    plan_id: int
    path: str
    reason: str
    message = "compaction plan {plan_id}: input {path} is unreadable: {reason}"


@dataclass(frozen=True)
class CompactionSpec:
    """Everything one plan's task needs; picklable, shipped to the Spark worker."""

    plan_id: int
    storage: Storage
    schema: CollectionSchema
    inputs: tuple[SegmentInfo, ...]
    delete_paths: tuple[str, ...]  # delta logs of the partition (live segments)
    output_ids: tuple[int, ...]
    log_id_base: int  # log ids log_id_base .. + LOG_IDS_PER_PLAN
    max_rows: int
    targets: tuple[SegmentInfo, ...] = ()  # L0 compaction: the segments that get the deletes
    expire_before: int = 0  # rows inserted before this expired (TTL): left out of the outputs


@dataclass(frozen=True)
class CompactionOutput:
    plan_id: int
    segments: tuple[SegmentInfo, ...]
    rows_in: int
    bytes_in: int
    changed: tuple[SegmentInfo, ...] = ()  # L0 compaction: targets with their new delta logs
    deletes_applied: tuple[str, ...] = ()  # the delta logs whose deletes removed input rows


LOG_IDS_PER_PLAN = 10_000


def outputs_needed(rows: int, max_rows: int) -> int:
    return max(1, -(-rows // max(1, max_rows)))


def run_compaction(spec: CompactionSpec) -> CompactionOutput:
    rows = _read_inputs(spec)
    rows_in = rows.num_rows
    rows = unexpired(rows, spec.expire_before)
    rows = apply_deletes_to(rows, _read_deletes(spec), spec.schema.primary.name)
    rows = rows.sort_by([(spec.schema.primary.name, "ascending"), ("timestamp", "ascending")])
    log_ids = iter(range(spec.log_id_base, spec.log_id_base + LOG_IDS_PER_PLAN))
    outputs = []
    for i, seg_id in enumerate(spec.output_ids):
        chunk = rows.slice(i * spec.max_rows, spec.max_rows)
        if chunk.num_rows:
            outputs.append(_write_output(spec, seg_id, chunk, log_ids))
    bytes_in = sum(b.size_bytes for s in spec.inputs for b in s.binlog_files)
    return CompactionOutput(
        spec.plan_id, tuple(outputs), rows_in, bytes_in, deletes_applied=spec.delete_paths
    )


def run_l0_compaction(spec: CompactionSpec) -> CompactionOutput:
    """The deletes of the L0 inputs, one delta log per target segment holding those whose
    pk the target may contain (pk range and bloom filter of its stats logs). Deletes keep
    their timestamps, so each still removes only older rows of its pk."""
    try:
        deletes = read_files(spec.storage, [b.path for s in spec.inputs for b in s.deltalogs])
        stats = {
            t.id: [PkStats.from_bytes(spec.storage.read_bytes(b.path)) for b in t.statslogs]
            for t in spec.targets
        }
    except StorageError as exc:
        raise CompactionInputError(spec.plan_id, exc.path, exc.reason) from None
    if deletes is None:
        deletes = empty_deletes()
    pks = deletes["pk"].to_numpy()
    log_ids = iter(range(spec.log_id_base, spec.log_id_base + LOG_IDS_PER_PLAN))
    changed = []
    for target in spec.targets:
        hit = np.zeros(len(pks), dtype=bool)
        for s in stats[target.id]:
            hit |= s.might_contain(pks)
        if not hit.any():
            changed.append(target)  # kept as it is (the commit drops only what is not listed)
            continue
        rows = deletes.filter(pa.array(hit))
        log_id = next(log_ids)
        key = delta_log_key(target.collection_id, target.partition_id, target.id, log_id)
        size = write_parquet(spec.storage, key, rows, vector=False)
        ts = rows["timestamp"].to_numpy()
        delta = Binlog(log_id, key, rows.num_rows, int(ts.min()), int(ts.max()), size)
        changed.append(target.with_changes(deltalogs=(*target.deltalogs, delta)))
    return CompactionOutput(
        spec.plan_id,
        (),
        deletes.num_rows,
        sum(b.size_bytes for s in spec.inputs for b in s.deltalogs),
        tuple(changed),
    )


def _read_inputs(spec: CompactionSpec) -> pa.Table:
    tables = []
    for seg in spec.inputs:
        try:
            tables.append(segment_rows(spec.storage, seg))
        except StorageError as exc:
            raise CompactionInputError(spec.plan_id, exc.path, exc.reason) from None
    return pa.concat_tables(tables) if tables else pa.table({})


def _read_deletes(spec: CompactionSpec) -> pa.Table:
    try:
        return read_deletes(spec.storage, spec.delete_paths)
    except StorageError as exc:
        raise CompactionInputError(spec.plan_id, exc.path, exc.reason) from None


def _write_output(spec: CompactionSpec, seg_id: int, rows: pa.Table, log_ids: Iterator[int]) -> SegmentInfo:
    first = spec.inputs[0]
    coll, part = first.collection_id, first.partition_id
    ts = rows["timestamp"]
    ts_from, ts_to = int(pa.compute.min(ts).as_py()), int(pa.compute.max(ts).as_py())
    fields = group_field_ids(spec.schema)
    groups = []
    for group, columns in column_groups(spec.schema):
        log_id = next(log_ids)
        key = insert_log_key(coll, part, seg_id, group, log_id)
        size = write_parquet(spec.storage, key, rows.select(["row_id", *columns[1:]]), group != SCALAR_GROUP)
        binlog = Binlog(log_id, key, rows.num_rows, ts_from, ts_to, size)
        groups.append(ColumnGroupBinlogs(group, fields[group], (binlog,)))
    stats_id = next(log_ids)
    stats_key = stats_log_key(coll, part, seg_id, stats_id)
    payload = PkStats.build(rows[spec.schema.primary.name]).to_bytes()
    spec.storage.write_atomic(stats_key, payload)
    return SegmentInfo(
        id=seg_id,
        collection_id=coll,
        partition_id=part,
        vchannel=first.vchannel,
        state=SegmentState.FLUSHED,
        level=SegmentLevel.L1,
        num_rows=rows.num_rows,
        max_rows=max(s.max_rows for s in spec.inputs),
        binlogs=tuple(groups),
        statslogs=(Binlog(stats_id, stats_key, rows.num_rows, ts_from, ts_to, len(payload)),),
        start_position=_earliest([s.start_position for s in spec.inputs]),
        dml_position=_latest([s.dml_position for s in spec.inputs]),
        compaction_from=tuple(s.id for s in spec.inputs),
        is_sorted=True,
        last_flush_ts=max(s.last_flush_ts for s in spec.inputs),
        created_at=time.time(),
        seal_ts=max(s.seal_ts for s in spec.inputs),
    )


def _earliest(positions: list[MsgPosition | None]) -> MsgPosition | None:
    known = [p for p in positions if p is not None]
    return min(known, key=lambda p: p.offset) if known else None


def _latest(positions: list[MsgPosition | None]) -> MsgPosition | None:
    known = [p for p in positions if p is not None]
    return max(known, key=lambda p: p.offset) if known else None


# --- running plans as Spark tasks ------------------------------------------------------------

RESULT_SCHEMA = pa.schema([("plan_id", pa.int64()), ("result", pa.binary())])


def run_compactions_arrow(
    specs: list[CompactionSpec], batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the input holds plan indices; each yields one row, the pickled
    CompactionOutput or the typed error (a bad input fails that plan only)."""
    for batch in batches:
        for index in batch.column(0).to_pylist():
            yield pa.RecordBatch.from_pylist([run_pickled(specs[int(index)])], schema=RESULT_SCHEMA)


def run_pickled(spec: CompactionSpec) -> dict[str, object]:
    try:
        result: object = run_l0_compaction(spec) if spec.targets else run_compaction(spec)
    except (CompactionInputError, ValueError, pa.ArrowException, OSError) as exc:
        result = (
            exc
            if isinstance(exc, CompactionInputError)
            else CompactionInputError(spec.plan_id, "(input rows)", str(exc))
        )
    return {"plan_id": spec.plan_id, "result": pickle.dumps(result)}


def outcome_of(row: dict[str, object]) -> CompactionOutput | CompactionInputError:
    raw = row["result"]
    assert isinstance(raw, bytes)
    found = pickle.loads(raw)
    assert isinstance(found, CompactionOutput | CompactionInputError)
    return found
