"""The query view of a vchannel in figures, and its two checks: what the Dagster
`visible_segments` asset records and checks, usable without Dagster.

- `view_figures`: segments the view serves as flushed, growing (not flushed yet) and
  invisible (flushed, waiting for their sort: served as growing), L0 and dropped ones; the
  rows of the served segments; the seek position; how long the oldest invisible segment
  has waited; flush -> sorted seconds of the sorts whose inputs are still in meta.
- `check_rows_served_once`: the view is a partition of the vchannel's rows at T. A read at
  T through the view (`query.reads.read_views`: its segments as they stood at T, its log
  tail, its deletes) returns every row of the log up to T that no delete at or before T
  removed, each exactly once, and nothing else. Rows are told apart by their log offset
  (a synced row's `row_id`), so a pk inserted again after its delete is a second row, not
  a pk served twice. T (`check_time`) is the last timestamp of the vchannel's head: every
  message at or before it is already in the log and no later message gets one, so the
  read and the log hold the same messages while producers go on.
  Cost: the scalar column group of every segment the view serves, their delta logs, and
  the pk and partition of every message the log still holds; proportional to the
  vchannel's data, nothing of other vchannels.
- `check_invisible_segments`: the flushed segments waiting for their sort number at most
  VCHAN_INVISIBLE_SEGMENT_LIMIT; more means the sort is not running or not keeping up.

Only what the log still holds is compared: rows below the first retained offset (log
retention) and bulk-imported rows (negative row ids: never in the log) are counted apart.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.config import Settings
from vchan_assets.datacoord.read_pins import pin_or_lost, pinned
from vchan_assets.datacoord.recovery import channel_checkpoint, start_position
from vchan_assets.datanode.checks import CheckOutcome, retained_log
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelHead, CollectionInfo, SegmentInfo, SegmentState, compose_ts
from vchan_assets.query.asof import at_or_before, iso, segments_at
from vchan_assets.query.reads import read_views
from vchan_assets.query.view import QueryView, collection_segments, index_ready, query_view
from vchan_assets.storage.rows import apply_deletes_to, concat_deletes, read_deletes
from vchan_assets.system import System
from vchan_assets.wal.format import MsgType

# --- figures ---------------------------------------------------------------------------------


def awaiting_sort(view: QueryView) -> list[SegmentInfo]:
    """The flushed segments the view serves as growing: their sort has not replaced them yet."""
    return [s for s in view.growing if s.state is SegmentState.FLUSHED and s.is_invisible]


def _oldest_wait(waiting: list[SegmentInfo], now: float) -> float:
    return max((now - s.flushed_at for s in waiting if s.flushed_at is not None), default=0.0)


def view_figures(view: QueryView, now: float) -> dict[str, int | float]:
    """The view of one vchannel in numbers (module docstring)."""
    waiting = awaiting_sort(view)
    waits = [w for s in view.dropped if (w := s.flush_to_sorted) is not None]
    return {
        "flushed": len(view.flushed),
        "growing": len(view.growing) - len(waiting),
        "invisible": len(waiting),
        "l0": len(view.l0),
        "dropped": len(view.dropped),
        "rows_in_served_segments": sum(s.num_rows for s in view.readable),
        "seek_offset": view.seek_position.offset,
        "seek_ts": view.seek_position.timestamp,
        "checkpoint_offset": view.checkpoint.offset if view.checkpoint else -1,
        "oldest_invisible_s": round(_oldest_wait(waiting, now), 2),
        "sorts_in_meta": len(waits),
        "flush_to_sorted_s_median": round(statistics.median(waits), 2) if waits else 0.0,
        "flush_to_sorted_s_max": round(max(waits), 2) if waits else 0.0,
    }


def view_revisions(store: MetaStore) -> dict[str, tuple[int, int]]:
    """Vchannel -> (newest etcd revision, count) of its segment meta, one listing for every
    collection: any change of a vchannel's view changes its pair (Dropped segments included:
    a view serves some of them)."""
    found = SegmentMeta(store).list(skip_malformed=True, include_dropped=True)
    out: dict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for d in found:
        newest, count = out[d.model.vchannel]
        out[d.model.vchannel] = (max(newest, d.kv.mod_revision), count + 1)
    return dict(out)


# --- checks ----------------------------------------------------------------------------------


def check_invisible_segments(view: QueryView, limit: int, now: float) -> CheckOutcome:
    waiting = awaiting_sort(view)
    oldest = _oldest_wait(waiting, now)
    return CheckOutcome(
        len(waiting) <= limit,
        f"{len(waiting)} flushed segments wait for their sort (VCHAN_INVISIBLE_SEGMENT_LIMIT={limit})"
        + (f", the oldest for {oldest:.0f}s: {[s.id for s in waiting[:5]]}" if waiting else ""),
        {"invisible": len(waiting), "limit": limit, "oldest_invisible_s": round(oldest, 2)},
    )


def check_time(store: MetaStore, settings: Settings, vchannel: str, now: float | None = None) -> int:
    """T of `check_rows_served_once`: the last timestamp of the vchannel's head, or half the
    time-travel window back from now if older (an idle vchannel: a read further back may
    need files garbage collection has removed since)."""
    found = store.get_model(store.keys.wal_head(vchannel), ChannelHead)
    now = time.time() if now is None else now
    recent = compose_ts(int((now - settings.time_travel / 2) * 1000))
    return max(found.model.last_ts if found else 0, recent)


def check_rows_served_once(system: System, info: CollectionInfo, vchannel: str, ts: int) -> CheckOutcome:
    """Whether a read at `ts` through the view of `vchannel` serves each live row of its
    log once (module docstring; `ts` from `check_time`)."""
    store, pk = system.store, info.schema.primary.name
    with pinned(store, system.settings, info.id, ts) as pin, pin_or_lost(store, pin):
        # The checkpoint before the segments: a sync committing in between leaves its rows
        # in both the log tail and the binlogs (the tail skips them by the segments' dml
        # positions), never in neither.
        found = channel_checkpoint(store, vchannel)
        segments = segments_at(collection_segments(store, info.id), ts)
        checkpoint, start = found.model if found else None, start_position(info, vchannel)
        view = query_view(segments, vchannel, checkpoint, start, index_ready(store, info.id, ts))
        served = read_views(system, info, segments, [view], ts, apply_deletes=True, with_vectors=False)
        partitions = {s.partition_id for s in (*view.flushed, *view.growing, *view.l0)}
        # The deletes the read applied, the upserts of bulk imports among them.
        applied = {p: at_or_before(read_deletes(system.storage, view.delta_paths(p)), ts) for p in partitions}
    retained = retained_log(system.storage, info, vchannel, None, ["partition_id"])
    expected = _live_rows(at_or_before(retained.table, ts), pk, applied)
    return _compare(served, expected, pk, retained.floor, ts)


def _live_rows(log: pa.Table, pk: str, applied: dict[int, pa.Table]) -> pa.Table:
    """The log's inserts minus those a delete removes (Milvus' rule, per partition): the
    log's deletes and those the read applied."""
    kinds = log["msg_type"]
    inserts = log.filter(pc.equal(kinds, MsgType.INSERT.value))
    deletes = log.filter(pc.equal(kinds, MsgType.DELETE.value))
    live = []
    for part in pc.unique(inserts["partition_id"]).to_pylist():
        mine = deletes.filter(pc.equal(deletes["partition_id"], part)).select([pk, "timestamp"])
        found = [mine.rename_columns(["pk", "timestamp"]), *([applied[part]] if part in applied else [])]
        rows = inserts.filter(pc.equal(inserts["partition_id"], part))
        live.append(apply_deletes_to(rows, concat_deletes(found), pk))
    return pa.concat_tables(live) if live else inserts


def _compare(served: pa.Table, expected: pa.Table, pk: str, floor: int, ts: int) -> CheckOutcome:
    ids = served["row_id"] if "row_id" in served.column_names else pa.chunked_array([], pa.int64())
    compared = pc.greater_equal(ids, floor)
    row_ids = np.asarray(ids.filter(compared).to_numpy(), dtype=np.int64)
    offsets = np.asarray(expected["offset"].to_numpy(), dtype=np.int64)
    distinct, counts = np.unique(row_ids, return_counts=True)
    twice = distinct[counts > 1]
    missing = np.setdiff1d(offsets, distinct)
    invented = np.setdiff1d(distinct, offsets)
    twice_pks = pc.unique(served.filter(pc.is_in(ids, pa.array(twice)))[pk]) if len(twice) else pa.array([])
    copies = int((counts - 1).sum())
    examples = [
        f"{what} {values[:5].tolist()}"
        for what, values in (
            ("offsets served twice", twice),
            ("offsets missing", missing),
            ("offsets not live in the log", invented),
        )
        if len(values)
    ]
    return CheckOutcome(
        copies == 0 and len(missing) == 0 and len(invented) == 0,
        f"read at {iso(ts)} through the view: {served.num_rows} rows, {len(offsets)} live rows in the log "
        f"from offset {floor}; {copies} served twice ({len(twice_pks)} pks), {len(missing)} missing, "
        f"{len(invented)} not live in the log" + (f": {'; '.join(examples)}" if examples else ""),
        {
            "as_of_ts": ts,
            "rows_served": served.num_rows,
            "log_rows": len(offsets),
            "rows_served_twice": copies,
            "pks_served_twice": len(twice_pks),
            "rows_missing": len(missing),
            "rows_not_in_log": len(invented),
            "retained_from_offset": floor,
            "rows_not_compared": served.num_rows - len(row_ids),
        },
    )
