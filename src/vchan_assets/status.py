"""`vchan status`: what is running and what needs attention, for operators.

`collect_status(catalog)` builds one JSON-ready report: DataNode sessions, channels
(owner, watch state, checkpoint, lag), segments by state and level, and warnings. The
segments come from the summaries the active DataCoord writes at its meta reload
(`meta/summary/{collection}`, datacoord/segment_summary.py), so the report reads no segment
key whatever their number; `SegmentDetail` (`vchan status --segments [--collection C]
[--vchannel V]`) reads segment meta itself, in pages and narrowed as asked, with a row per
segment. The warnings:
  - segment summaries: a collection without one, a malformed one, and summaries older than
    SUMMARY_STALE_AFTER while no DataCoord is active to keep them current;
  - time-tick lag: a channel with unsynced messages whose checkpoint is older than
    `timetick_lag_warn` seconds (DataCoord's time-tick lag warning);
  - write back-pressure: a channel whose unsynced log is past half VCHAN_WRITE_LAG_LIMIT_MB
    (`writes_slowed`) or past it (`writes_refused`);
  - stuck watches: ToWatch / ToRelease past their timeout (`watch_timeout`);
  - channels on a node without a live session (the node died; the active coordinator
    moves them, and if there is none the warning says so and how to start one) and
    channels waiting as "remaining" (no live node);
  - services: the active DataCoord (who holds the election), and the Dagster daemon and
    webserver `vchan up` started (a dead one: "run `vchan up`");
  - orphan binlogs, on request (`vchan status --orphans`: it lists storage and every
    segment's binlogs): files no segment meta points to (left by a crash; GC removes them);
  - failed tasks: sort or index tasks of the DataCoord's scheduler out of attempts, with
    their reason (`vchan index --retry` re-queues failed index builds);
  - log errors: a damaged log file a sync needs (the channel stops; its lag shows "?"),
    and damaged files wholly below the checkpoint (already synced; nothing stops);
  - idle change streams: a registered stream unseen for VCHAN_STREAM_IDLE_TIMEOUT, which
    no longer holds log retention back;
  - data lost: every damaged log file or binlog an operator quarantined (`vchan
    quarantine`), with the offsets or rows lost, for good (the records are never deleted).
The report also lists the change streams (`datacoord.streams`): committed offsets, how
far behind the log head, last seen, and whether they hold retention back.
`render_status(report)` draws it as rich tables.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Group
from rich.table import Table
from rich.text import Text

from vchan_assets import catalog_tables as tables
from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import RELOAD_INTERVAL
from vchan_assets.datacoord.segment_summary import latency_quantile, summarize
from vchan_assets.datacoord.streams import is_idle, list_streams
from vchan_assets.datacoord.tasks import list_tasks
from vchan_assets.deploy.service import daemon_state, instance_home
from vchan_assets.lifecycle.plans import ACTIVE, CompactionPlan, list_plans
from vchan_assets.meta.channelwatch import REMAINING, WatchListing
from vchan_assets.meta.embedded import pid_alive
from vchan_assets.meta.errors import MalformedValueError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.model import (
    CollectionInfo,
    NodeSession,
    SegmentSummary,
    SessionState,
    TaskRecord,
    TaskState,
)
from vchan_assets.wal.backpressure import SLOW_FROM

# The election key's address of a coordinator hosted by the Dagster DataCoord sensor.
DAGSTER_COORDINATOR = "dagster:datacoord"
NO_COORDINATOR = (
    "no DataCoord is active to move it: the Dagster daemon is down (run `vchan up`) "
    "or no `vchan datacoord` runs"
)

STUCK_STATES = ("ToWatch", "ToRelease")
CHANNEL_COLUMNS = (
    "vchannel",
    "collection",
    "owner",
    "watch",
    "lease",
    "checkpoint",
    "head",
    "lag msgs",
    "lag s",
)


def _plain(value: Any) -> Any:
    """A DataFrame cell as a JSON value."""
    if value is None:
        return None
    if isinstance(value, pd.Timestamp):
        return value.isoformat()
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return _plain(value.item())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    try:
        if pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return value


def _records(df: pd.DataFrame, columns: list[str]) -> list[dict[str, Any]]:
    return [{c: _plain(row[c]) for c in columns} for _, row in df.iterrows()]


# The columns of a channel in the JSON report (the table shows CHANNEL_COLUMNS).
JSON_CHANNEL_COLUMNS = [
    "vchannel", "collection", "owner_node", "owner_alive", "watch_state", "lease_node",
    "checkpoint_offset", "checkpoint_time", "head_offset", "lag_rows", "lag_seconds",
    "checkpoint_age_seconds", "syncs", "log_error", "log_damaged", "backlog_bytes",
]  # fmt: skip


def _nodes(sessions: list[NodeSession], channels: pd.DataFrame, now: float) -> list[dict[str, Any]]:
    per_node = Counter(str(o) for o in channels["owner_node"] if o is not None)
    return [
        {
            "node_id": s.node_id,
            "address": s.address,
            "version": s.version,
            "state": s.state,
            "state_reason": s.reason or None,  # why it is ABNORMAL
            "state_since": pd.Timestamp(s.since, unit="s", tz="UTC").isoformat() if s.since else None,
            "started_at": pd.Timestamp(s.started_at, unit="s", tz="UTC").isoformat(),
            "uptime_seconds": round(max(0.0, now - s.started_at), 1),
            "channels": per_node.get(str(s.node_id), 0),
        }
        for s in sessions
    ]


def _handoff(
    summaries: list[SegmentSummary],
    names: dict[int, str],
    settings: Settings,
    now: float,
    holds: dict[int, str],
) -> dict[str, Any]:
    """The hand-off after flush: segments invisible now (served as growing until sorted),
    the oldest of them, what each late one waits on (`holds`: by segment, see
    `_what_holds`), and the flush -> sorted latency of the sorts still in meta (quantiles
    of the summaries' histograms, to within about 2 %)."""
    waiting = [(w, s.collection_id) for s in summaries for w in s.oldest_invisible]
    latency = [b for s in summaries for b in s.sort_latency]
    late_after = max(120.0, 2 * settings.sort_scan_interval)
    stuck: list[dict[str, Any]] = [
        {
            "segment": w.segment_id,
            "collection": names.get(cid, str(cid)),
            "invisible_s": round(now - w.flushed_at, 1),
            "waits_on": holds.get(w.segment_id, NO_SORT_TASK),
        }
        for w, cid in waiting
        if now - w.flushed_at > late_after
    ]
    p50, p95 = (latency_quantile(latency, q) for q in (0.5, 0.95))
    return {
        "invisible": sum(g.invisible for s in summaries for g in s.groups),
        "oldest_invisible_s": round(max(now - w.flushed_at for w, _ in waiting), 1) if waiting else None,
        "sorted": sum(b.count for b in latency),
        "flush_to_sorted_p50_s": None if p50 is None else round(p50, 2),
        "flush_to_sorted_p95_s": None if p95 is None else round(p95, 2),
        # Past this an invisible segment means the sort is not running or not keeping up.
        "late_after_s": late_after,
        "stuck": sorted(stuck, key=lambda r: -r["invisible_s"])[:STUCK_SHOWN],
    }


STUCK_SHOWN = 20  # late invisible segments listed, the oldest first
NO_SORT_TASK = "no sort task or plan holds it: is an active DataCoord (or the Dagster sort sensor) running?"


def _what_holds(tasks: list[TaskRecord], plans: list[CompactionPlan], now: float) -> dict[int, str]:
    """What each segment with an active plan or a sort task waits on, in words."""
    holds: dict[int, str] = {}
    for t in tasks:
        if t.kind != "sort":
            continue
        if t.state is TaskState.FAILED:
            again = f"; tried again in {t.not_before - now:.0f}s" if t.not_before else ""
            holds[t.segment_id] = f"its sort task Failed after {t.attempts} attempts: {t.reason}{again}"
        elif t.state is TaskState.IN_PROGRESS:
            holds[t.segment_id] = f"its sort task, running on {t.worker} for {now - t.started_at:.0f}s"
        elif t.not_before > now:
            holds[t.segment_id] = f"its sort task, queued, next try in {t.not_before - now:.0f}s: {t.reason}"
        else:
            holds[t.segment_id] = "its sort task, queued"
    for p in plans:
        if p.state in ACTIVE:
            by = f" on {p.worker}" if p.worker else ""
            for seg in p.input_ids:
                holds[seg] = f"compaction plan {p.plan_id} ({p.type}, {p.state}{by})"
    return holds


def _handoff_warnings(handoff: dict[str, Any]) -> list[dict[str, Any]]:
    oldest = handoff["oldest_invisible_s"]
    if oldest is None or oldest <= handoff["late_after_s"]:
        return []
    return [
        {
            "kind": "sort_behind",
            "count": handoff["invisible"],
            "message": f"{handoff['invisible']} flushed segments still invisible (waiting for their sort), "
            f"the oldest for {oldest:.0f}s: "
            + "; ".join(f"segment {r['segment']} waits on {r['waits_on']}" for r in handoff["stuck"][:3]),
        }
    ]


def _segment_rows(summaries: list[SegmentSummary], names: dict[int, str]) -> list[dict[str, Any]]:
    """Per (collection, state, level), over its vchannels: segments, rows, insert binlog
    bytes, how many are sorted by pk, how many are invisible (flushed, waiting for their
    sort) and how many a compaction wrote (their `compaction_from` names the segments they
    replaced)."""
    counts: dict[tuple[str, str, str], Counter[str]] = defaultdict(Counter)
    for summary in summaries:
        name = names.get(summary.collection_id, str(summary.collection_id))
        for g in summary.groups:
            counts[(name, g.state.value, g.level.value)].update({k: getattr(g, k) for k in SEGMENT_COUNTS})
    return [
        {"collection": c, "state": s, "level": lvl, **{k: n[k] for k in SEGMENT_COUNTS}}
        for (c, s, lvl), n in sorted(counts.items())
    ]


SEGMENT_COUNTS = ("segments", "rows", "binlog_bytes", "sorted", "invisible", "compacted")


def _channel_warnings(
    channel_rows: list[dict[str, Any]], live: set[str], settings: Settings, coordinator: str | None
) -> list[dict[str, Any]]:
    warnings: list[dict[str, Any]] = []
    for row in channel_rows:
        if row["log_error"]:
            warnings.append({"kind": "log_error", "vchannel": row["vchannel"], "message": row["log_error"]})
        for damage in row["log_damaged"] or ():
            warnings.append(
                {
                    "kind": "log_damaged_below_checkpoint",
                    "vchannel": row["vchannel"],
                    "message": f"{row['vchannel']}: already synced, the channel goes on: {damage}",
                }
            )
        warnings += _write_lag_warning(row, settings)
        age = row["checkpoint_age_seconds"]
        if row["lag_rows"] and age is not None and age > settings.timetick_lag_warn:
            warnings.append(
                {
                    "kind": "timetick_lag",
                    "vchannel": row["vchannel"],
                    "message": f"{row['vchannel']}: checkpoint is {age:.0f}s old with {row['lag_rows']} "
                    f"messages behind it (warning after {settings.timetick_lag_warn:.0f}s)",
                }
            )
        owner = row["owner_node"]
        if owner is None:
            warnings.append(
                {
                    "kind": "unassigned",
                    "vchannel": row["vchannel"],
                    "message": f"{row['vchannel']}: no watch info; no DataNode is assigned to it",
                }
            )
        elif owner == REMAINING:
            warnings.append(
                {
                    "kind": "unassigned",
                    "vchannel": row["vchannel"],
                    "message": f"{row['vchannel']}: waiting for a live DataNode (remaining)",
                }
            )
        elif owner not in live:
            warnings.append(
                {
                    "kind": "dead_owner",
                    "vchannel": row["vchannel"],
                    "node": owner,
                    "message": f"{row['vchannel']}: watched by node {owner}, which has no live session; "
                    + (f"the active DataCoord ({coordinator}) moves it" if coordinator else NO_COORDINATOR),
                }
            )
    return warnings


def _write_lag_warning(row: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    """A channel whose unsynced log is past half the write lag limit: its producers are
    slowed, or refused past the limit (`wal.backpressure`)."""
    limit = settings.write_lag_limit_mb
    held = (row["backlog_bytes"] or 0) / 2**20
    if limit <= 0 or held < SLOW_FROM * limit:
        return []
    state = "refused" if held > limit else "slowed"
    return [
        {
            "kind": f"writes_{state}",
            "vchannel": row["vchannel"],
            "message": f"{row['vchannel']}: {held:.0f} MB of log not synced (VCHAN_WRITE_LAG_LIMIT_MB="
            f"{limit:g}): inserts and deletes are {state} until its DataNode catches up",
        }
    ]


def _watch_warnings(watches: WatchListing, now: float) -> list[dict[str, Any]]:
    warnings: list[dict[str, Any]] = []
    for bad in watches.malformed:
        warnings.append(
            {"kind": "malformed_watch", "vchannel": bad.vchannel, "node": bad.node, "message": bad.error}
        )
    for entry in watches.entries:
        if entry.info.state.value in STUCK_STATES and entry.info.timeout_ts and entry.info.timeout_ts < now:
            warnings.append(
                {
                    "kind": "stuck_watch",
                    "vchannel": entry.vchannel,
                    "node": str(entry.node_id),
                    "message": f"{entry.vchannel}: {entry.info.state.value} on node {entry.node_id} "
                    f"past its timeout by {now - entry.info.timeout_ts:.0f}s",
                }
            )
    return warnings


def active_coordinator(catalog: Catalog) -> str | None:
    """Who holds the DataCoord election ("node 12 (dagster:datacoord)"), or None."""
    key = catalog.store.keys.datacoord_session()
    try:
        found = catalog.store.get_model(key, NodeSession)
    except MalformedValueError:
        return f"a malformed value at {key}"
    if found is None:
        return None
    host = "the Dagster sensor" if found.model.address == DAGSTER_COORDINATOR else found.model.address
    state = "" if found.model.state is SessionState.HEALTHY else f" {found.model.state.value}"
    return f"node {found.model.node_id} ({host or 'vchan datacoord'}){state}"


def dagster_services(settings: Settings, now: float | None = None) -> dict[str, str]:
    """The Dagster daemon and webserver `vchan up` recorded: "up (pid N)", "down (pid N
    died)", or nothing if `vchan up` never ran here. A live daemon's state comes from the
    heartbeats its daemons (sensors, run queue, monitoring) write to the Dagster instance:
    "up (pid N, heartbeat 4 s ago)", "starting (...)" before the first, "hung (...)" when
    one is older than HEARTBEAT_STALE_AFTER."""
    try:
        state = json.loads((settings.home / "dagster" / "service.json").read_text())
        pids = [int(p) for p in state.get("pids", [])]
    except (OSError, ValueError, TypeError):
        return {}
    now = time.time() if now is None else now
    out = {}
    for name, pid in zip(("dagster_daemon", "dagster_webserver"), pids, strict=False):
        if not pid_alive(pid):
            out[name] = f"down (pid {pid} died)"
        elif name == "dagster_daemon":
            home = state.get("dagster_home") or instance_home(settings)
            out[name] = daemon_state(pid, Path(home), now)
        else:
            out[name] = f"up (pid {pid})"
    return out


def _service_warnings(services: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {
            "kind": "service_down",
            "service": name,
            "message": f"the {name.replace('_', ' ')} is {state}"
            + ("" if state.startswith("hung") else ": run `vchan up` to start it again"),
        }
        for name, state in services.items()
        if state.startswith(("down", "hung"))
    ]


def _streams(catalog: Catalog, channels: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The registered change streams: what each committed, how far behind the log head it
    is, and whether it still holds log retention back (seen within the idle timeout)."""
    heads = {c["vchannel"]: c["head_offset"] for c in channels}
    out = []
    for stream_id, record in sorted(list_streams(catalog.store).items()):
        behind = [
            max(0, heads[o.vchannel] - o.offset) for o in record.offsets if heads.get(o.vchannel) is not None
        ]
        out.append(
            {
                "stream": stream_id,
                "collection": record.collection,
                "committed": {o.vchannel: o.offset for o in record.offsets},
                "behind_head": sum(behind),
                "last_seen_seconds": round(now - record.last_seen, 1),
                "holds_retention": not is_idle(record, now, catalog.settings.stream_idle_timeout),
                "host": record.host,
                "pid": record.pid,
            }
        )
    return out


def _stream_warnings(streams: list[dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    return [
        {
            "kind": "idle_stream",
            "stream": s["stream"],
            "message": f"change stream {s['stream']} ({s['collection']}) unseen for {s['last_seen_seconds']:,.0f}s "
            f"(VCHAN_STREAM_IDLE_TIMEOUT={settings.stream_idle_timeout:g}s): it no longer holds log "
            "retention back, and fails if it comes back after its offsets are removed",
        }
        for s in streams
        if not s["holds_retention"]
    ]


@dataclass(frozen=True)
class SegmentDetail:
    """`vchan status --segments`: segment meta read itself (in pages, through the meta
    door), narrowed to a collection and/or a vchannel (then read through its index), with a
    row per segment, instead of the DataCoord's summaries."""

    collection: str | None = None
    vchannel: str | None = None


# A summary older than this while no DataCoord is active may be behind segment meta (the
# active one rewrites it at its reload, every RELOAD_INTERVAL, whenever segment meta changed).
SUMMARY_STALE_AFTER = 3 * RELOAD_INTERVAL
SEGMENTS_HINT = "`vchan status --segments` reads segment meta itself"

SEGMENT_DETAIL_COLUMNS = [
    "segment_id", "collection", "partition_id", "vchannel", "state", "level", "num_rows", "size_bytes",
    "is_sorted", "invisible", "compaction_from", "flushed_at", "flush_to_sorted_s",
]  # fmt: skip


@dataclass
class SegmentView:
    """What the report says of segments, and where it came from."""

    summaries: list[SegmentSummary]
    source: str  # "summary" or "segment meta"
    detail: list[dict[str, Any]] | None = None  # a row per segment (`--segments`)
    warnings: list[dict[str, Any]] = field(default_factory=list)


def _from_summaries(
    catalog: Catalog, collections: list[CollectionInfo], coordinator: str | None, now: float
) -> SegmentView:
    """The DataCoord's summaries (one key per collection); a collection without one, a
    malformed one, and old ones while no DataCoord is active are warned of."""
    store = catalog.store
    prefix = store.keys.segment_summary.prefix
    view = SegmentView([], "summary")
    held = set()
    for kv in store.list_prefix(prefix).items:
        held.add(kv.key[len(prefix) :])
        try:
            view.summaries += [d.model for d in store.decode_models([kv], SegmentSummary)]
        except MalformedValueError as exc:
            view.warnings.append({"kind": "malformed_summary", "message": f"{exc}: {SEGMENTS_HINT}"})
    for info in collections:
        if str(info.id) not in held and not info.dropped_at:
            view.warnings.append(
                {
                    "kind": "no_segment_summary",
                    "collection": info.name,
                    "message": f"collection {info.name} has no segment summary (the active DataCoord "
                    f"writes it at its meta reload): its segments are not counted here; "
                    f"`vchan status --segments --collection {info.name}` reads them",
                }
            )
    old = [s for s in view.summaries if now - s.computed_at > SUMMARY_STALE_AFTER]
    if coordinator is None and old:
        oldest = max(now - s.computed_at for s in old)
        view.warnings.append(
            {
                "kind": "stale_segment_summary",
                "count": len(old),
                "message": f"no DataCoord is active to keep the segment summaries current: {len(old)} "
                f"are older than {SUMMARY_STALE_AFTER:.0f}s (the oldest {oldest:.0f}s) and may be behind "
                f"segment meta; {SEGMENTS_HINT}",
            }
        )
    return view


def _from_segment_meta(
    catalog: Catalog, detail: SegmentDetail, names: dict[int, str], now: float
) -> SegmentView:
    """Segment meta (the Dropped segments GC keeps included, as the summaries count them)
    listed in pages, narrowed as asked; its summaries computed here."""
    collection = catalog.collection(detail.collection).id if detail.collection else None
    door = SegmentMeta(catalog.store)
    found = [
        d.model
        for d in door.list(collection, vchannel=detail.vchannel, skip_malformed=True, include_dropped=True)
    ]
    summaries = summarize(found, [] if collection is None else [collection], 0, now)
    rows = [tables.segment_row(seg, names.get(seg.collection_id)) for seg in found]
    return SegmentView(
        list(summaries.values()),
        "segment meta",
        [{c: _plain(row[c]) for c in SEGMENT_DETAIL_COLUMNS} for row in rows],
    )


def collect_status(
    catalog: Catalog, now: float | None = None, orphans: bool = False, segments: SegmentDetail | None = None
) -> dict[str, Any]:
    """The whole report as plain JSON values. Segments come from the DataCoord's summaries
    (no segment key is read), or with `segments` from segment meta itself, narrowed as
    asked, with a row per segment (`segment_detail`). `orphans`: list storage and every
    segment's binlogs for the files no segment names (`vchan status --orphans`)."""
    now = time.time() if now is None else now
    settings = catalog.settings
    sessions = catalog.sessions()
    channels = catalog.vchannels(now=now)
    channel_rows = _records(channels, JSON_CHANNEL_COLUMNS)
    live = {str(s.node_id) for s in sessions}
    nodes = _nodes(sessions, channels, now)
    collections = catalog.collection_infos(include_dropped=True)
    names = {c.id: c.name for c in collections}
    coordinator = active_coordinator(catalog)
    view = (
        _from_summaries(catalog, collections, coordinator, now)
        if segments is None
        else _from_segment_meta(catalog, segments, names, now)
    )
    task_records = [d.model for d in list_tasks(catalog.store)]
    plans = [d.model for d in list_plans(catalog.store)]
    handoff = _handoff(view.summaries, names, settings, now, _what_holds(task_records, plans, now))
    services = dagster_services(settings, now)
    streams = _streams(catalog, channel_rows, now)
    warnings = [
        *_service_warnings(services),
        *_channel_warnings(channel_rows, live, settings, coordinator),
        *_watch_warnings(catalog.watches(), now),
        *view.warnings,
        *_handoff_warnings(handoff),
        *_stream_warnings(streams, settings),
    ]
    tasks = _tasks(names, task_records)
    warnings += _task_warnings(tasks)
    losses = _records(catalog.data_losses(), LOSS_COLUMNS)
    warnings += _loss_warnings(losses)
    orphan_count = None
    if orphans:
        found = catalog.orphans()
        orphan_count = len(found)
        if found:
            warnings.append(
                {
                    "kind": "orphan_binlogs",
                    "count": len(found),
                    "examples": found[:3],
                    "message": f"{len(found)} binlog files no segment points to (crash leftovers; "
                    "garbage collection removes them)",
                }
            )
    return {
        "time": pd.Timestamp(now, unit="s", tz="UTC").isoformat(),
        "etcd": ",".join(catalog.store.endpoints),
        "root": settings.root,
        "storage": catalog.storage.uri,
        "datacoord": coordinator,
        "services": services,
        "nodes": nodes,
        "channels": channel_rows,
        "segments": _segment_rows(view.summaries, names),
        "segments_source": view.source,
        "segment_summaries": _summary_times(view, names, now),
        "segment_detail": view.detail,
        "handoff": handoff,
        "orphan_binlogs": orphan_count,
        "compactions": _records(catalog.compactions(), COMPACTION_COLUMNS),
        "imports": _records(catalog.imports(), IMPORT_COLUMNS),
        "tasks": tasks,
        "data_losses": losses,
        "streams": streams,
        "warnings": warnings,
    }


TASK_COLUMNS = ["kind", "collection", "segment", "state", "attempts", "worker", "reason"]


def _summary_times(view: SegmentView, names: dict[int, str], now: float) -> list[dict[str, Any]]:
    """When each summary the report counted was computed, and from which revision."""
    if view.source != "summary":
        return []
    return [
        {
            "collection": names.get(s.collection_id, str(s.collection_id)),
            "revision": s.revision,
            "computed_at": pd.Timestamp(s.computed_at, unit="s", tz="UTC").isoformat(),
            "age_seconds": round(now - s.computed_at, 1),
        }
        for s in view.summaries
    ]


def _tasks(names: dict[int, str], records: list[TaskRecord]) -> list[dict[str, Any]]:
    """The DataCoord scheduler's tasks (queued, in progress, failed), sorts first."""
    rows = [
        {
            "kind": t.kind,
            "collection": names.get(t.collection_id, str(t.collection_id)),
            "segment": t.segment_id,
            "state": t.state.value,
            "attempts": t.attempts,
            "worker": t.worker,
            "reason": t.reason,
            "next_try": t.not_before or None,  # a backed-off or Failed task's next attempt (epoch s)
        }
        for t in records
    ]
    return sorted(rows, key=lambda r: (r["kind"] != "sort", r["collection"], r["segment"]))


def _task_warnings(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in tasks:
        if t["state"] != TaskState.FAILED.value:
            continue
        again = f"tried again on its own in {t['next_try'] - time.time():.0f}s; " if t["next_try"] else ""
        retry = f"{again}`vchan tasks --retry` re-queues it now"
        out.append(
            {
                "kind": "task_failed",
                "task": t["kind"],
                "collection": t["collection"],
                "segment": t["segment"],
                "message": f"{t['kind']} task of segment {t['segment']} ({t['collection']}) failed "
                f"{t['attempts']} times: {t['reason']} ({retry})",
            }
        )
    return out


LOSS_COLUMNS = [
    "loss_id", "collection", "kind", "vchannel", "first_offset", "last_offset", "segment_id", "rows",
    "path", "reason", "at",
]  # fmt: skip


def _lost(loss: dict[str, Any]) -> str:
    if loss["kind"] == "binlog":
        return (
            f"segment {loss['segment_id']} ({loss['collection']}): {loss['rows']} rows lost, damaged binlog"
        )
    return (
        f"{loss['vchannel']} ({loss['collection']}): offsets {loss['first_offset']}..{loss['last_offset']} "
        "lost, damaged log file"
    )


def _loss_warnings(losses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A warning per quarantined file, for good: the loss is never silent."""
    return [
        {
            "kind": "data_lost",
            "collection": loss["collection"],
            "vchannel": loss["vchannel"],
            "message": f"{_lost(loss)} {loss['path']} quarantined at {loss['at']} ({loss['reason']})",
        }
        for loss in losses
    ]


COMPACTION_COLUMNS = [
    "plan_id",
    "collection",
    "type",
    "state",
    "inputs",
    "outputs",
    "rows_in",
    "rows_out",
    "reason",
]

IMPORT_COLUMNS = ["job_id", "collection", "state", "progress", "files", "rows", "imported_rows", "reason"]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _lag_cell(channel: dict[str, Any], column: str) -> str:
    """A lag figure, "?" while the channel's log cannot be read (unknown is not 0)."""
    return "?" if channel["log_error"] else _cell(channel[column])


def render_status(report: dict[str, Any]) -> Group:
    """The report as rich tables: nodes, channels, segments, warnings."""
    header = Text.assemble(
        ("vchan status ", "bold"),
        f"{report['time']}  etcd {report['etcd']}  root {report['root']}  storage {report['storage']}\n",
        f"DataCoord: {report['datacoord'] or 'none active'}",
        *(f"  {name.replace('_', ' ')}: {state}" for name, state in report["services"].items()),
    )
    nodes = Table(title="DataNodes (live sessions)", title_justify="left")
    for column in ("node", "address", "version", "state", "uptime s", "channels"):
        nodes.add_column(column)
    for n in report["nodes"]:
        state = n["state"] + (f" ({n['state_reason']})" if n.get("state_reason") else "")
        nodes.add_row(
            str(n["node_id"]), n["address"], n["version"], state, _cell(n["uptime_seconds"]),
            str(n["channels"]),
        )  # fmt: skip
    if not report["nodes"]:
        nodes.add_row("-", "no DataNode session", "", "", "", "")

    channels = Table(title="vchannels", title_justify="left")
    for column in CHANNEL_COLUMNS:
        numeric = column in ("checkpoint", "head", "lag msgs", "lag s")
        channels.add_column(column, justify="right" if numeric else "left", no_wrap=column == "vchannel")
    for c in report["channels"]:
        owner = c["owner_node"] or "-"
        style = "" if c["owner_alive"] else "red"
        channels.add_row(
            c["vchannel"],
            c["collection"],
            Text(f"{owner}{'' if c['owner_alive'] or owner == '-' else ' (dead)'}", style=style),
            c["watch_state"] or "-",
            "-" if c["lease_node"] is None else str(c["lease_node"]),
            _cell(c["checkpoint_offset"]),
            _cell(c["head_offset"]),
            _lag_cell(c, "lag_rows"),
            _lag_cell(c, "lag_seconds"),
        )

    h = report["handoff"]
    latency = (
        f"flush -> sorted p50 {h['flush_to_sorted_p50_s']}s p95 {h['flush_to_sorted_p95_s']}s over {h['sorted']}"
        if h["sorted"]
        else "no sort in meta yet"
    )
    oldest = f", oldest {h['oldest_invisible_s']}s" if h["invisible"] else ""
    source = (
        "from the DataCoord's summaries"
        if report["segments_source"] == "summary"
        else "read from segment meta"
    )
    title = f"segments by state, {source} (hand-off: {h['invisible']} invisible{oldest}; {latency})"
    segments = Table(title=title, title_justify="left")
    for column in ("collection", "state", "level", *SEGMENT_COUNTS):
        segments.add_column(column, justify="right" if column in SEGMENT_COUNTS else "left")
    for s in report["segments"]:
        segments.add_row(s["collection"], s["state"], s["level"], *(_cell(s[k]) for k in SEGMENT_COUNTS))

    detail = _segment_detail(report.get("segment_detail"))
    plans = _recent(
        "compaction plans", report.get("compactions", []), COMPACTION_COLUMNS, "no compaction plan"
    )
    jobs = _recent("import jobs", report.get("imports", []), IMPORT_COLUMNS, "no import job")
    tasks = _recent("sort and index tasks", report.get("tasks", []), TASK_COLUMNS, "no task queued")
    streams = Table(title='change streams (readStream.format("vchan"))', title_justify="left")
    for column in ("stream", "collection", "committed", "behind head", "last seen s", "holds log"):
        streams.add_column(column)
    for st in report.get("streams", []):
        streams.add_row(
            st["stream"],
            st["collection"],
            ", ".join(f"{v}: {o:,}" for v, o in st["committed"].items()),
            _cell(st["behind_head"]),
            _cell(st["last_seen_seconds"]),
            Text("yes") if st["holds_retention"] else Text("no (idle)", style="yellow"),
        )
    if not report.get("streams"):
        streams.add_row("-", "no registered stream", "", "", "", "")

    warnings = Table(title="warnings", title_justify="left")
    warnings.add_column("kind")
    warnings.add_column("message")
    for w in report["warnings"]:
        warnings.add_row(Text(w["kind"], style="yellow"), w["message"])
    if not report["warnings"]:
        warnings.add_row(Text("none", style="green"), "nothing needs attention")
    return Group(header, nodes, channels, segments, *detail, plans, jobs, tasks, streams, warnings)


def _segment_detail(rows: list[dict[str, Any]] | None) -> list[Table]:
    """A row per segment (`vchan status --segments`), none by default."""
    if rows is None:
        return []
    table = Table(title=f"segments ({len(rows):,})", title_justify="left")
    for column in SEGMENT_DETAIL_COLUMNS:
        table.add_column(column.replace("_", " "))
    for r in rows:
        table.add_row(
            *(_cell(r[c]) if not isinstance(r[c], list) else str(r[c]) for c in SEGMENT_DETAIL_COLUMNS)
        )
    return [table]


def _recent(title: str, records: list[dict[str, Any]], columns: list[str], empty: str) -> Table:
    """The last 20 records (compaction plans, import jobs, tasks) as a table."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column.replace("_", " "))
    for r in records[-20:]:
        table.add_row(*(_cell(r[c]) if not isinstance(r[c], list) else str(r[c]) for c in columns))
    if not records:
        table.add_row("-", empty, *([""] * (len(columns) - 2)))
    return table
