"""The hand-off in the lineage: `segments` -> `sorted_segments` -> `visible_segments`.

`visible_segments`, partitioned by vchannel, is the query view of the vchannel (`query/view.py`):
what every reader sees of it, materialized with its figures (segments served as flushed,
growing, invisible (flushed, waiting for their sort), L0; rows served; the seek position;
the oldest invisible segment's wait; flush -> sorted seconds) and two checks
(`query/checks.py`): a read at T through the view serves each live row of the log once, and
the invisible segments stay within VCHAN_INVISIBLE_SEGMENT_LIMIT.

`query_view_sensor` requests one run (`query_view`) for the vchannels whose segment meta
changed (a sync, a flush, a sort, a compaction, GC), at most every VIEW_SENSOR_INTERVAL seconds
and never while one is queued or running, whoever runs the lifecycle (Dagster or a
`vchan datacoord` process): the view is only read, and a sort that stopped shows as a failing
check instead of an asset never materialized. The run reports each vchannel's view as a
materialization of its partition, with its checks (as the sync loop reports syncs), so the
view runs grow with time, not with the sync rate (a run per vchannel per change, as before, is
a run per sync and vchannel at production's sync rate). Materializing a partition from the UI
runs the asset.
"""

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg

from vchan_assets.defs.checks import (
    ReportedEvent,
    VchannelResults,
    asset_checks,
    check_result,
    report_each_vchannel,
    typed,
)
from vchan_assets.defs.lifecycle.assets import COMPACTED_SEGMENTS, LIFECYCLE_GROUP, SORTED_SEGMENTS
from vchan_assets.defs.partitions import VCHANNELS, VchannelsConfig, vchannels, vchannels_run_request
from vchan_assets.defs.resources import VchanEnvResource, VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.sync.assets import SEGMENTS
from vchan_assets.defs.sync.sensor import IN_FLIGHT
from vchan_assets.model import CollectionInfo
from vchan_assets.query.asof import iso
from vchan_assets.query.checks import (
    check_invisible_segments,
    check_rows_served_once,
    check_time,
    view_figures,
    view_revisions,
)
from vchan_assets.query.view import read_query_view

VISIBLE_SEGMENTS = dg.AssetKey("visible_segments")
VIEW_SENSOR_INTERVAL = 30  # seconds: the check reads the whole vchannel, so not at every sync

CHECK_SERVED_ONCE, CHECK_INVISIBLE = asset_checks(
    VISIBLE_SEGMENTS,
    rows_served_once="A read at T through the view returns each live row of the vchannel's log up to T "
    "exactly once (no pk served twice, none missing) and nothing else. Reads the vchannel's data.",
    invisible_segments_bounded="Flushed segments waiting for their sort (invisible: served as growing) "
    "are at most VCHAN_INVISIBLE_SEGMENT_LIMIT; more: the sort is not running or not keeping up.",
)


@dg.asset(
    key=VISIBLE_SEGMENTS,
    deps=[SEGMENTS, SORTED_SEGMENTS, COMPACTED_SEGMENTS],
    partitions_def=vchannels,
    group_name=LIFECYCLE_GROUP,
    kinds={"etcd", "parquet"},
    description="The query view of the vchannel, what every reader sees: segments served as flushed "
    "(sorted, compacted), as growing (not flushed, or flushed and invisible until their sort "
    "replaces them), L0 deletes, and the seek position of the log tail.",
    check_specs=[CHECK_SERVED_ONCE, CHECK_INVISIBLE],
)
def visible_segments(context: dg.AssetExecutionContext, vchan: VchanResource) -> object:
    """The vchannel's query view now, and a read at its last timestamp checked against its log."""
    with vchan.open() as runtime:
        vchannel = context.partition_key
        materialized, checks = view_results(runtime, runtime.collection_of(vchannel), vchannel, context.log)
    yield materialized
    yield from checks


def view_results(
    runtime: VchanRuntime, info: CollectionInfo, vchannel: str, log: logging.Logger | dg.DagsterLogManager
) -> VchannelResults:
    """The materialization of `visible_segments` for `vchannel` (of collection `info`) and its
    two check results."""
    settings = runtime.settings
    now = time.time()
    view = read_query_view(runtime.store, info, vchannel)
    ts = check_time(runtime.store, settings, vchannel, now)
    served = check_rows_served_once(runtime, info, vchannel, ts)
    invisible = check_invisible_segments(view, settings.invisible_segment_limit, now)
    figures = view_figures(view, now)
    log.info(
        "%s: %d flushed, %d invisible, %d growing; %s",
        vchannel,
        figures["flushed"],
        figures["invisible"],
        figures["growing"],
        served.description,
    )
    materialized: dg.MaterializeResult[None] = dg.MaterializeResult(
        asset_key=VISIBLE_SEGMENTS,
        metadata=typed({**figures, "rows_served": served.metadata["rows_served"], "as_of": iso(ts)}),
    )
    return materialized, [check_result(CHECK_SERVED_ONCE, served), check_result(CHECK_INVISIBLE, invisible)]


@dg.op(name="query_views", out={})
def query_views(
    context: dg.OpExecutionContext, config: VchannelsConfig, vchan: VchanResource
) -> Iterator[ReportedEvent]:
    """Materialize `visible_segments` for each of the vchannels, one partition after another,
    with its two checks, as events of this run; a vchannel dropped meanwhile is skipped. A
    vchannel whose view cannot be read (malformed meta, unreadable files) does not keep the
    others from being reported: the run fails at the end, naming it and why."""
    with vchan.open() as runtime:
        live = runtime.vchannels()
        yield from report_each_vchannel(
            context.log,
            config.vchannels,
            live,
            lambda vchannel: view_results(runtime, live[vchannel], vchannel, context.log),
            "the view",
        )


# A view run reads the vchannels' rows for the check: one at a time in the instance, and
# after the syncs in the queue (the instance's dagster.yaml limits the `vchan/view` tag to 1
# run; a lower priority is dequeued last), so views never hold the run slots syncs need.
VIEW_RUN_TAGS = {"vchan/view": "query_view", "dagster/priority": "-1"}

query_view_job = dg.GraphDefinition(name="query_view", node_defs=[query_views]).to_job(
    executor_def=dg.in_process_executor,
    description="The query views of the vchannels whose segments changed: each a materialization of "
    "visible_segments (partition = vchannel) with its checks.",
)


@dg.sensor(
    job=query_view_job,
    minimum_interval_seconds=VIEW_SENSOR_INTERVAL,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def query_view_sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
    """One view run for the vchannels whose segment meta changed since the sensor last asked
    for their view (the cursor: each vchannel's newest revision and count of segment meta),
    none while a view run is queued or running: the view runs grow with time (one per
    VIEW_SENSOR_INTERVAL at most), not with the sync rate or the number of vchannels. The
    vchannels of a view run that failed (its process never started in time on a loaded
    machine, or a view could not be read) are asked for again, up to twice for one state."""
    instance = context.instance
    if instance.get_runs_count(dg.RunsFilter(job_name=query_view_job.name, statuses=IN_FLIGHT)):
        return dg.SensorResult(skip_reason="a view run is queued or running")
    seen: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    for v in _last_failed_views(instance):
        seen.pop(v, None)
    with vchan_env.open() as runtime:
        changed = view_revisions(runtime.store)
        live = set(runtime.vchannels())
    known = set(instance.get_dynamic_partitions(VCHANNELS)) & live
    now = {v: f"{revision}-{count}" for v, (revision, count) in changed.items() if v in known}
    due = {v: stamp for v, stamp in now.items() if seen.get(v) != stamp}
    if not due:
        return dg.SensorResult(skip_reason="no vchannel whose segments changed", cursor=json.dumps(now))
    request = vchannels_run_request(instance, query_views.name, due, VIEW_RUN_TAGS)
    return dg.SensorResult(run_requests=[request], cursor=json.dumps(now))


def _last_failed_views(instance: dg.DagsterInstance) -> list[str]:
    """The vchannels of the newest view run, if it failed."""
    last = instance.get_run_records(dg.RunsFilter(job_name=query_view_job.name), limit=1)
    if not last or last[0].dagster_run.status is not dg.DagsterRunStatus.FAILURE:
        return []
    config: Any = last[0].dagster_run.run_config or {}  # (as vchannels_run_request wrote it)
    return list(config.get("ops", {}).get(query_views.name, {}).get("config", {}).get("vchannels", []))
