"""The hand-off in the lineage: `segments` -> `sorted_segments` -> `visible_segments`.

`visible_segments`, partitioned by vchannel, is the query view of the vchannel (`query/view.py`):
what every reader sees of it, materialized with its figures (segments served as flushed,
growing, invisible (flushed, waiting for their sort), L0; rows served; the seek position;
the oldest invisible segment's wait; flush -> sorted seconds) and two checks
(`query/checks.py`): a read at T through the view serves each live row of the log once, and
the invisible segments stay within VCHAN_INVISIBLE_SEGMENT_LIMIT.

`query_view_sensor` requests a run for each vchannel whose segment meta changed (a sync, a
flush, a sort, a compaction, GC), at most every VIEW_SENSOR_INTERVAL seconds, whoever runs
the lifecycle (Dagster or a `vchan datacoord` process): the view is only read, and a sort
that stopped shows as a failing check instead of an asset never materialized.
"""

import time

import dagster as dg

from vchan_assets.defs.checks import asset_checks, check_result, typed
from vchan_assets.defs.lifecycle.assets import COMPACTED_SEGMENTS, LIFECYCLE_GROUP, SORTED_SEGMENTS
from vchan_assets.defs.partitions import VCHANNELS, vchannels
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.sync.assets import SEGMENTS
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
    vchannel = context.partition_key
    with vchan.open() as runtime:
        settings = runtime.settings
        info = runtime.collection_of(vchannel)
        now = time.time()
        view = read_query_view(runtime.store, info, vchannel)
        ts = check_time(runtime.store, settings, vchannel, now)
        served = check_rows_served_once(runtime, info, vchannel, ts)
    invisible = check_invisible_segments(view, settings.invisible_segment_limit, now)
    figures = view_figures(view, now)
    context.log.info(
        "%s: %d flushed, %d invisible, %d growing; %s",
        vchannel,
        figures["flushed"],
        figures["invisible"],
        figures["growing"],
        served.description,
    )
    yield dg.MaterializeResult(
        metadata=typed({**figures, "rows_served": served.metadata["rows_served"], "as_of": iso(ts)})
    )
    yield check_result(CHECK_SERVED_ONCE, served)
    yield check_result(CHECK_INVISIBLE, invisible)


# A view run reads its vchannel's rows for the check: one at a time in the instance, and
# after the syncs in the queue (the instance's dagster.yaml limits the `vchan/view` tag to 1
# run; a lower priority is dequeued last), so views never hold the run slots syncs need.
VIEW_RUN_TAGS = {"vchan/view": "query_view", "dagster/priority": "-1"}

query_view_job = dg.define_asset_job(
    "query_view",
    selection=dg.AssetSelection.assets(VISIBLE_SEGMENTS),  # partitioned by vchannel like the asset
    executor_def=dg.in_process_executor,
    description="The query view of one vchannel, materialized and checked.",
)


@dg.sensor(
    job=query_view_job,
    minimum_interval_seconds=VIEW_SENSOR_INTERVAL,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def query_view_sensor(context: dg.SensorEvaluationContext, vchan: VchanResource) -> dg.SensorResult:
    """A `visible_segments` run for each vchannel whose segment meta changed since its last
    run (the run key: the newest revision and the count of its segment meta)."""
    with vchan.open() as runtime:
        changed = view_revisions(runtime.store)
        live = set(runtime.vchannels())
    known = set(context.instance.get_dynamic_partitions(VCHANNELS)) & live
    requests = [
        dg.RunRequest(run_key=f"view-{v}-{revision}-{count}", partition_key=v, tags=VIEW_RUN_TAGS)
        for v, (revision, count) in sorted(changed.items())
        if v in known
    ]
    if not requests:
        return dg.SensorResult(skip_reason="no vchannel with segments")
    return dg.SensorResult(run_requests=requests)
