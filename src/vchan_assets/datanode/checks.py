"""Invariant checks of one vchannel over its *committed range* [0, checkpoint]:
what the Dagster asset checks report after every sync, usable without Dagster.
Once log retention deleted the oldest log files, `check_log_rows` compares the range
the log still holds, [first retained offset, checkpoint], and reports that floor.

- `check_log_rows`: the insert binlogs hold exactly the log's inserts of that range and
  the delta logs exactly its deletes. Deletes are not applied to insert binlogs (they go
  to L0 delta logs, as in Milvus 2.4+), so "rows minus deletes where they belong" is: the
  entries of the L1 scalar-group insert binlogs == the Insert messages in the range, the
  entries of the L0 delta logs == the Delete messages, and the live rows = inserted pks
  minus deleted pks that had been inserted before. After a compaction removed deleted
  rows physically, the live insert binlogs hold between the live rows and the inserts.
  Only live (not Dropped) segments count: compaction drops its inputs.
- `check_unique_pks`: no primary key appears twice in the channel's insert binlogs.
- `check_binlog_paths`: every binlog, delta log and stats log path in segment meta exists.

(Checkpoint monotonicity needs the previous materialization: the asset layer checks it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.datacoord.recovery import channel_checkpoint, channel_segments
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import Binlog, CollectionInfo, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage, StorageError
from vchan_assets.wal.format import CorruptLogError, MsgType, wal_prefix
from vchan_assets.wal.reader import WalReader


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, int | float | str] = field(default_factory=dict)


def _segments(store: MetaStore, collection: CollectionInfo, vchannel: str) -> list[SegmentInfo]:
    """The live segments written from the log: a Dropped one was replaced by a compaction's
    output (or emptied); a bulk import's rows never were in the log (its own checks count them)."""
    found = channel_segments(store, collection.id, vchannel)
    return [
        d.model for d in found if d.model.state is not SegmentState.DROPPED and d.model.import_job is None
    ]


def _insert_binlogs(segments: list[SegmentInfo]) -> list[Binlog]:
    """The scalar-group (group 0: row id, timestamp, pk, scalars) insert binlogs: one
    entry per inserted row."""
    return [
        b
        for s in segments
        if s.level is not SegmentLevel.L0
        for g in s.binlogs
        if g.group == 0
        for b in g.logs
    ]


@dataclass(frozen=True)
class RetainedLog:
    """What the log still holds of a channel's committed range: log retention deletes the
    files wholly below the checkpoint, so only offsets from `floor` on can be compared."""

    floor: int  # the first offset still in the log (0 while nothing was deleted)
    table: pa.Table  # offset, msg_type, pk of [floor, checkpoint]


def _empty_log(pk: str) -> pa.Table:
    return pa.table(
        {
            "offset": pa.array([], pa.int64()),
            "msg_type": pa.array([], pa.string()),
            pk: pa.array([], pa.int64()),
        }
    )


def _retained_log(storage: Storage, collection: CollectionInfo, vchannel: str, up_to: int) -> RetainedLog:
    """The retained log up to `up_to`; listed again if a retention pass deletes a file
    between the listing and the read (the floor then moves up)."""
    pk = collection.schema.primary.name
    for _ in range(3):
        files = WalReader(storage, vchannel, collection).files_between(-1, up_to)
        floor = files[0].first_offset if files else 0
        try:
            tables = [storage.read_parquet(f.key, columns=["offset", "msg_type", pk]) for f in files]
        except StorageError:
            if all(storage.exists(f.key) for f in files):
                raise
            continue
        table = pa.concat_tables(tables) if tables else _empty_log(pk)
        return RetainedLog(floor, table.filter(pc.less_equal(table["offset"], up_to)))
    raise CorruptLogError(storage.path(wal_prefix(vchannel)), "files kept disappearing while read")


def _count_from(storage: Storage, logs: list[Binlog], column: str, floor: int) -> int:
    """Entries of `logs` whose log offset (`column`) is at or above `floor`: all of them
    while the log is whole, else read from the files."""
    if floor == 0:
        return sum(b.entries for b in logs)
    return sum(
        pc.sum(pc.greater_equal(storage.read_parquet(b.path, columns=[column])[column], floor)).as_py() or 0
        for b in logs
    )


def check_log_rows(
    store: MetaStore, storage: Storage, collection: CollectionInfo, vchannel: str
) -> CheckOutcome:
    found = channel_checkpoint(store, vchannel)
    if found is None:
        return CheckOutcome(True, "no checkpoint yet: nothing committed", {"log_inserts": 0})
    cp = found.model
    retained = _retained_log(storage, collection, vchannel, cp.offset)
    log_table, floor = retained.table, retained.floor
    kinds = log_table["msg_type"]
    log_inserts = pc.sum(pc.equal(kinds, MsgType.INSERT.value)).as_py() or 0
    log_deletes = pc.sum(pc.equal(kinds, MsgType.DELETE.value)).as_py() or 0
    segs = _segments(store, collection, vchannel)
    # Insert binlogs carry the log offset as row_id, delta logs as offset.
    binlog_rows = _count_from(storage, _insert_binlogs(segs), "row_id", floor)
    deltalogs = [b for s in segs for b in s.deltalogs]
    delta_rows = _count_from(storage, deltalogs, "offset", floor)
    pk = collection.schema.primary.name
    inserted = set(log_table.filter(pc.equal(kinds, MsgType.INSERT.value))[pk].to_pylist())
    deleted = set(log_table.filter(pc.equal(kinds, MsgType.DELETE.value))[pk].to_pylist())
    live = len(inserted - deleted)
    # A compaction removed deleted rows physically: the live binlogs then hold fewer rows
    # than the log inserted, but never fewer than the live pks.
    compacted = any(s.compaction_from for s in segs)
    rows_ok = binlog_rows == log_inserts or (compacted and live <= binlog_rows <= log_inserts)
    # An L0 compaction copies each delete into every segment that may hold its pk.
    moved = any(s.deltalogs for s in segs if s.level is not SegmentLevel.L0)
    deltas_ok = delta_rows == log_deletes
    if moved and not deltas_ok:
        delta_pks = set()
        for b in deltalogs:
            table = storage.read_parquet(b.path, columns=["pk", "offset"])
            delta_pks |= set(table.filter(pc.greater_equal(table["offset"], floor))["pk"].to_pylist())
        deltas_ok = delta_pks <= deleted  # every delete still in the log, none invented
    scope = (
        f"committed range [0, {cp.offset}]"
        if floor == 0
        else f"retained range [{floor}, {cp.offset}] (log retention deleted offsets below {floor})"
    )
    return CheckOutcome(
        rows_ok and deltas_ok,
        f"{scope}: insert binlogs {binlog_rows} / log inserts {log_inserts}, "
        f"delta logs {delta_rows} / log deletes {log_deletes}, live rows {live}",
        {
            "checkpoint_offset": cp.offset,
            "retained_from_offset": floor,
            "log_inserts": log_inserts,
            "binlog_rows": binlog_rows,
            "log_deletes": log_deletes,
            "deltalog_rows": delta_rows,
            "live_rows": live,
        },
    )


def check_unique_pks(
    store: MetaStore, storage: Storage, collection: CollectionInfo, vchannel: str
) -> CheckOutcome:
    pk = collection.schema.primary.name
    paths = [b.path for b in _insert_binlogs(_segments(store, collection, vchannel))]
    if not paths:
        return CheckOutcome(True, "no insert binlogs yet", {"rows": 0, "duplicates": 0})
    columns = [storage.read_parquet(path, columns=[pk])[pk] for path in paths]
    pks = pa.chunked_array([c for col in columns for c in col.chunks], type=pa.int64())
    distinct = len(pc.unique(pks))
    dupes = len(pks) - distinct
    return CheckOutcome(
        dupes == 0,
        f"{len(pks)} rows, {distinct} distinct primary keys",
        {"rows": len(pks), "duplicates": dupes},
    )


def check_binlog_paths(
    store: MetaStore, storage: Storage, collection: CollectionInfo, vchannel: str
) -> CheckOutcome:
    paths = [
        b.path
        for s in _segments(store, collection, vchannel)
        for b in (*s.binlog_files, *s.deltalogs, *s.statslogs)
    ]
    return files_exist_outcome(storage, paths, "paths in segment meta", "paths")


def files_exist_outcome(storage: Storage, paths: list[str], what: str, count_key: str) -> CheckOutcome:
    """Passes when every one of `paths` exists; names the first missing ones."""
    missing = [p for p in paths if not storage.exists(p)]
    return CheckOutcome(
        not missing,
        f"{len(paths)} {what}, {len(missing)} missing" + (f": {', '.join(missing[:5])}" if missing else ""),
        {count_key: len(paths), "missing": len(missing)},
    )
