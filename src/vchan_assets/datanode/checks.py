"""Invariant checks of one vchannel over its *committed range* [0, checkpoint]:
what the Dagster asset checks report after every sync, usable without Dagster.
Once log retention deleted the oldest log files, `check_log_rows` compares the range
the log still holds, [first retained offset, checkpoint], and reports that floor.

- `check_log_rows`: the live segments hold the log's inserts and deletes of that range,
  value by log offset (insert binlogs carry it as row_id, delta logs as offset): no row
  or delete that is not in the log or is there twice; every insert is in an insert
  binlog unless a later delete of its pk removed it (compaction applies deletes); every
  delete is in a delta log (an L0 one, or copied to its targets by L0 compaction) unless
  it was applied: no live row of its pk older than it is left. Only live (not Dropped)
  segments count: compaction drops its inputs.
- `check_unique_pks`: no primary key appears twice in the channel's insert binlogs.
- `check_binlog_paths`: every binlog, delta log and stats log path in segment meta exists.
- `check_checkpoints_fresh`: no vchannel with log messages to sync waits longer than a limit
  (VCHAN_CHECKPOINT_FRESHNESS) for its checkpoint to advance.

(Checkpoint monotonicity needs the previous materialization: the asset layer checks it.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.datacoord.recovery import channel_checkpoint, channel_segments
from vchan_assets.datanode.policies import ChannelBacklog
from vchan_assets.fields import arrow_type
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import Binlog, CollectionInfo, SegmentInfo, SegmentLevel, SegmentState, physical_ms
from vchan_assets.storage import Storage, StorageError
from vchan_assets.wal.format import CorruptLogError, MsgType, log_schema, wal_prefix
from vchan_assets.wal.reader import WalReader, read_log_file


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
    table: pa.Table  # offset, msg_type, timestamp, pk (and the extra columns) of [floor, up_to]


def retained_log(
    storage: Storage,
    collection: CollectionInfo,
    vchannel: str,
    up_to: int | None,
    extra: Sequence[str] = (),
) -> RetainedLog:
    """The retained log up to offset `up_to` (None: to its end), with the `extra` log
    columns too; listed again if a retention pass deletes a file between the listing and
    the read (the floor then moves up)."""
    pk = collection.schema.primary.name
    columns = ["offset", "msg_type", "timestamp", pk, *extra]
    for _ in range(3):
        files = WalReader(storage, vchannel, collection).files_between(-1, up_to)
        floor = files[0].first_offset if files else 0
        try:
            tables = [
                read_log_file(storage, f.key, collection.schema, columns[3:]).select(columns) for f in files
            ]
        except (StorageError, CorruptLogError):
            if all(storage.exists(f.key) for f in files):
                raise
            continue
        table = (
            pa.concat_tables(tables)
            if tables
            else log_schema(collection.schema).empty_table().select(columns)
        )
        return RetainedLog(
            floor, table if up_to is None else table.filter(pc.less_equal(table["offset"], up_to))
        )
    raise CorruptLogError(storage.path(wal_prefix(vchannel)), "files kept disappearing while read")


def _read(storage: Storage, logs: list[Binlog], columns: list[str]) -> dict[str, list[int]]:
    tables = [storage.read_parquet(b.path, columns=columns) for b in logs]
    if not tables:
        return {c: [] for c in columns}
    table = pa.concat_tables(tables)
    return {c: table[c].to_pylist() for c in columns}


def _messages(log_table: pa.Table, kind: MsgType, pk: str) -> list[tuple[int, int, int]]:
    """(offset, pk, timestamp) of the log's messages of one kind."""
    t = log_table.filter(pc.equal(log_table["msg_type"], kind.value))
    return list(zip(t["offset"].to_pylist(), t[pk].to_pylist(), t["timestamp"].to_pylist(), strict=True))


def check_log_rows(
    store: MetaStore, storage: Storage, collection: CollectionInfo, vchannel: str
) -> CheckOutcome:
    found = channel_checkpoint(store, vchannel)
    if found is None:
        return CheckOutcome(True, "no checkpoint yet: nothing committed", {"log_inserts": 0})
    cp = found.model
    retained = retained_log(storage, collection, vchannel, cp.offset)
    floor, pk = retained.floor, collection.schema.primary.name
    inserts = _messages(retained.table, MsgType.INSERT, pk)
    deletes = _messages(retained.table, MsgType.DELETE, pk)
    segs = _segments(store, collection, vchannel)
    # Insert binlogs carry the log offset as row_id, delta logs as offset.
    try:
        rows = _read(storage, _insert_binlogs(segs), ["row_id", pk, "timestamp"])
        deltas = _read(storage, [b for s in segs for b in s.deltalogs], ["offset", "pk", "timestamp"])
    except StorageError as exc:  # a committed binlog that cannot be read: the check fails, naming it
        return CheckOutcome(False, f"committed binlogs unreadable: {exc}", {"unreadable": 1})
    row_ids = [r for r in rows["row_id"] if r >= floor]
    delta_offsets = {o for o in deltas["offset"] if o >= floor}
    # The latest delete of each pk (the log's and the live delta logs'), and the oldest live row.
    latest_delete: dict[int, int] = {}
    for key, ts in [*((p, t) for _, p, t in deletes), *zip(deltas["pk"], deltas["timestamp"], strict=True)]:
        latest_delete[key] = max(ts, latest_delete.get(key, ts))
    oldest_row: dict[int, int] = {}
    for key, ts in zip(rows[pk], rows["timestamp"], strict=True):
        oldest_row[key] = min(ts, oldest_row.get(key, ts))
    insert_offsets = {o for o, _, _ in inserts}
    delete_offsets = {o for o, _, _ in deletes}
    held = set(row_ids)
    # A row may be missing only if a later delete removed it (compaction applies deletes);
    # a delete may be missing from the delta logs only once applied (no older row left).
    lost_rows = sum(1 for o, p, t in inserts if o not in held and latest_delete.get(p, -1) <= t)
    lost_deletes = sum(1 for o, p, t in deletes if o not in delta_offsets and oldest_row.get(p, t) < t)
    invented = len(row_ids) - len(held) + len(held - insert_offsets) + len(delta_offsets - delete_offsets)
    scope = (
        f"committed range [0, {cp.offset}]"
        if floor == 0
        else f"retained range [{floor}, {cp.offset}] (log retention deleted offsets below {floor})"
    )
    return CheckOutcome(
        lost_rows == 0 and lost_deletes == 0 and invented == 0,
        f"{scope}: insert binlogs {len(row_ids)} / log inserts {len(inserts)}, delta logs "
        f"{len(delta_offsets)} / log deletes {len(deletes)}; lost rows {lost_rows}, lost deletes "
        f"{lost_deletes}, rows or deletes not in the log or twice {invented}",
        {
            "checkpoint_offset": cp.offset,
            "retained_from_offset": floor,
            "log_inserts": len(inserts),
            "binlog_rows": len(row_ids),
            "log_deletes": len(deletes),
            "deltalog_rows": len(delta_offsets),
            "lost_rows": lost_rows,
            "lost_deletes": lost_deletes,
            "invented": invented,
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
    pks = pa.chunked_array(
        [c for col in columns for c in col.chunks], type=arrow_type(collection.schema.primary)
    )
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


def check_checkpoints_fresh(backlogs: Sequence[ChannelBacklog], limit: float, now: float) -> CheckOutcome:
    """Freshness of the channel checkpoints: fails when a vchannel with log messages to sync
    (rows, deletes, DDL past its checkpoint) holds a batch older than `limit` seconds, i.e. its checkpoint did
    not advance past that batch within the limit. A channel with nothing to sync is fresh
    however old its checkpoint is."""
    waits = {
        b.vchannel: max(0.0, now - physical_ms(b.oldest_unsynced_ts) / 1000)
        for b in backlogs
        if b.has_unsynced and b.oldest_unsynced_ts is not None
    }
    stale = sorted(v for v, wait in waits.items() if wait > limit)
    oldest = max(waits.values(), default=0.0)
    summary = f"{len(stale)} of {len(backlogs)} vchannels stale (limit {limit:g}s, oldest unsynced batch {oldest:.0f}s)"
    return CheckOutcome(
        not stale,
        summary + (": " + ", ".join(stale[:20]) if stale else ""),
        {
            "vchannels": len(backlogs),
            "with_messages_to_sync": len(waits),
            "stale": len(stale),
            "oldest_unsynced_s": round(oldest, 1),
            "limit_s": limit,
        },
    )
