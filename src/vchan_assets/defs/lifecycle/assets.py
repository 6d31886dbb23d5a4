"""The segment lifecycle as assets downstream of `segments`:

- `sorted_segments`, partitioned by vchannel: the stats task after flush, run through the
  DataCoord's task scheduler (`sort_tasks.sort_vchannel`: a sort task per segment, with the
  attempts, backoff and Failed state of `vchan datacoord`). `sort_sensor` requests one `sort`
  run for every vchannel with newly flushed unsorted segments whose task may run (not
  backing off, not Failed), at most every SORT_SENSOR_INTERVAL seconds and never while one is
  queued or running; the run reports each vchannel's sorts as a materialization of its
  partition, with its check (as the sync loop reports syncs), so sort runs grow with time,
  not with the flush rate or the number of vchannels. Materializing a partition from the UI
  runs the asset;
- `compacted_segments` (L0, mix and leftover sort plans of the DataCoord lifecycle step:
  sorts of segments flushed more than VCHAN_SORT_LEFTOVER_AFTER seconds ago)
  and `garbage_collection` (orphans, dropped segments, old log files), materialized
  together by one step every VCHAN_LIFECYCLE_INTERVAL (`lifecycle_sensor`);

with checks. The steps are the ones the `vchan datacoord` process runs (lifecycle/step.py);
while such a process leads the DataCoord election both sensors stand by (one lifecycle)."""

import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator

import dagster as dg

from vchan_assets.datacoord.tasks import prune_tasks
from vchan_assets.defs.checks import (
    ReportedEvent,
    VchannelResults,
    asset_checks,
    check_result,
    report_each_vchannel,
    typed,
)
from vchan_assets.defs.cluster.datanodes import DAGSTER_ADDRESS
from vchan_assets.defs.partitions import VCHANNELS, VchannelsConfig, vchannels, vchannels_run_request
from vchan_assets.defs.resources import VchanEnvResource, VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.sync.assets import SEGMENTS
from vchan_assets.defs.sync.sensor import IN_FLIGHT
from vchan_assets.defs.tasks import log_held, task_metadata
from vchan_assets.indexes.gc import collect_indexes
from vchan_assets.lifecycle.checks import (
    check_live_files_exist,
    check_rows_conserved,
    check_unique_live_pks,
    storage_figures,
)
from vchan_assets.lifecycle.plans import CompactionPlan, PlanState
from vchan_assets.lifecycle.sort_tasks import sort_vchannel, sorts_due
from vchan_assets.lifecycle.step import lifecycle_step, unsorted_segments
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import NodeSession, SegmentInfo, physical_ms

SORTED_SEGMENTS = dg.AssetKey("sorted_segments")
COMPACTED_SEGMENTS = dg.AssetKey("compacted_segments")
GARBAGE_COLLECTION = dg.AssetKey("garbage_collection")
LIFECYCLE_GROUP = "segment_lifecycle"
# seconds between sort runs at most: a flushed segment waits for its sort (served as growing)
# up to this long plus the run's launch, and the runs stay under 5,760 a day
SORT_SENSOR_INTERVAL = 15

(CHECK_SORTED_ROWS,) = asset_checks(
    SORTED_SEGMENTS,
    blocking=True,
    sorted_rows_conserved="Per sort: rows in = rows out + rows its deletes removed (recomputed).",
)
CHECK_ROWS, CHECK_UNIQUE = asset_checks(
    COMPACTED_SEGMENTS,
    blocking=True,
    rows_conserved="Per compaction of the step: rows in = rows out + rows its deletes removed (recomputed).",
    no_pk_in_two_live_segments="No primary key visible in two live segments of a vchannel (rows a newer delete removes do not count).",
)
(CHECK_FILES,) = asset_checks(
    GARBAGE_COLLECTION,
    live_meta_files_exist="Every file named by the meta of a live segment exists after the GC pass.",
)


def _plans(store: MetaStore, plan_ids: list[int]) -> list[CompactionPlan]:
    return [
        found.model
        for pid in plan_ids
        if (found := store.get_model(store.keys.compaction_plan(pid), CompactionPlan)) is not None
    ]


@dg.asset(
    key=SORTED_SEGMENTS,
    deps=[SEGMENTS],
    partitions_def=vchannels,
    group_name=LIFECYCLE_GROUP,
    kinds={"spark", "etcd"},
    description="The stats task after flush: each newly flushed segment of the vchannel rewritten sorted "
    "by pk with a fresh stats log (pk range, bloom filter), swapped for it in one etcd transaction.",
    check_specs=[CHECK_SORTED_ROWS],
)
def sorted_segments(context: dg.AssetExecutionContext, vchan: VchanResource) -> object:
    """Sort the vchannel's newly flushed segments (one job); how long each waited since its flush."""
    vchannel = context.partition_key
    with vchan.open() as runtime:
        waiting = unsorted_segments(runtime.store, vchannel)
        materialized, checks = sort_results(runtime, vchannel, waiting, context.log)
    yield materialized
    yield from checks


def sort_results(
    runtime: VchanRuntime,
    vchannel: str,
    waiting: list[SegmentInfo],
    log: logging.Logger | dg.DagsterLogManager,
) -> VchannelResults:
    """Sort the newly flushed segments of `vchannel` (`waiting`: its unsorted segments, as
    listed before) through their sort tasks: the materialization of `sorted_segments` for it
    (how many, their rows, how long each waited since its flush, the tasks' attempts and the
    segments held back: Failed or backing off, with their next try) and its check."""
    store, storage = runtime.store, runtime.storage
    flushed_at = {s.id: physical_ms(s.last_flush_ts) / 1000 for s in waiting}
    sorts = sort_vchannel(runtime, "spark", waiting)
    outcomes = sorts.plans
    done = time.time()
    completed = [o.plan_id for o in outcomes if o.state is PlanState.COMPLETED]
    plans = _plans(store, completed)
    rows = check_rows_conserved(store, storage, plans)
    waited = [done - flushed_at[i] for p in plans for i in p.input_ids if i in flushed_at]
    log.info("%s: %d segments sorted, %d failed", vchannel, len(completed), len(outcomes) - len(completed))
    log_held(log, f"{vchannel}: sort", sorts.held)
    materialized: dg.MaterializeResult[None] = dg.MaterializeResult(
        asset_key=SORTED_SEGMENTS,
        metadata=typed(
            {
                "sorted": len(completed),
                "failed": len(outcomes) - len(completed),
                "rows": sum(p.rows_out for p in plans),
                "flush_to_sorted_s_median": round(statistics.median(waited), 2) if waited else 0.0,
                "flush_to_sorted_s_max": round(max(waited), 2) if waited else 0.0,
                **task_metadata(sorts.report, sorts.held),
            }
        ),
    )
    return materialized, [check_result(CHECK_SORTED_ROWS, rows)]


def lifecycle_elsewhere(store: MetaStore) -> str:
    """Why the lifecycle sensors stand by: a `vchan datacoord` process leads the DataCoord
    election and runs the lifecycle itself. "" while Dagster's DataCoord leads, or nobody."""
    found = store.get_model(store.keys.datacoord_session(), NodeSession)
    if found is None or found.model.address.startswith(DAGSTER_ADDRESS):
        return ""
    return f"the DataCoord process {found.model.node_id} ({found.model.address}) runs the lifecycle"


@dg.op(name="sort_segments", out={})
def sort_segments(
    context: dg.OpExecutionContext, config: VchannelsConfig, vchan: VchanResource
) -> Iterator[ReportedEvent]:
    """Sort the newly flushed segments of each of the vchannels, one after another, and report
    each as a materialization of its `sorted_segments` partition with its check; a vchannel
    dropped meanwhile is skipped. A vchannel whose sort raises does not keep the others from
    being sorted: the run fails at the end, naming it and why (its segments stay flushed,
    served as growing, and the sensor asks for them again when what waits changes)."""
    with vchan.open() as runtime:
        waiting: dict[str, list[SegmentInfo]] = defaultdict(list)
        for s in unsorted_segments(runtime.store):  # one listing for the run, not one per vchannel
            waiting[s.vchannel].append(s)
        yield from report_each_vchannel(
            context.log,
            config.vchannels,
            runtime.vchannels(),
            lambda vchannel: sort_results(runtime, vchannel, waiting[vchannel], context.log),
            "the sort",
        )


sort_job = dg.GraphDefinition(name="sort", node_defs=[sort_segments]).to_job(
    executor_def=dg.in_process_executor,
    description="The stats task of the vchannels with newly flushed segments: each sorted by pk, "
    "each a materialization of sorted_segments (partition = vchannel) with its check.",
)


@dg.sensor(
    job=sort_job,
    minimum_interval_seconds=SORT_SENSOR_INTERVAL,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def sort_sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
    """Sort right after flush: one `sort` run for every vchannel with newly flushed unsorted
    segments whose sort task may run now (`sorts_due`: one backing off after a failed
    attempt, or Failed, waits for its time), none while a sort run is queued or running;
    once per state of what waits (the run key: each vchannel's newest such segment and their
    tasks' etcd revisions), and a task whose backoff passed is asked for again. A run that
    failed leaving the tasks as they were (its process never started in time on a loaded
    machine, or died) is asked for again up to twice; one whose sort failed recorded the
    attempt, so what waits changed (or backs off)."""
    if context.instance.get_runs_count(dg.RunsFilter(job_name=sort_job.name, statuses=IN_FLIGHT)):
        return dg.SensorResult(skip_reason="a sort run is queued or running")
    with vchan_env.open() as runtime:
        elsewhere = lifecycle_elsewhere(runtime.store)
        due = [] if elsewhere else sorts_due(runtime.store, time.time())
        known = set(context.instance.get_dynamic_partitions(VCHANNELS))
    if elsewhere:
        return dg.SensorResult(skip_reason=elsewhere)
    stamps: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s, revision in due:
        if s.vchannel in known:
            stamp = stamps[s.vchannel]
            stamp[0], stamp[1] = max(stamp[0], s.id), max(stamp[1], revision)
    if not stamps:
        return dg.SensorResult(
            skip_reason="no newly flushed segment waits for its sort (or their tasks wait for their next try)"
        )
    return dg.SensorResult(run_requests=[vchannels_run_request(context.instance, sort_segments.name, stamps)])


@dg.multi_asset(
    name="segment_lifecycle",
    specs=[
        dg.AssetSpec(
            COMPACTED_SEGMENTS,
            deps=[
                SEGMENTS,
                SORTED_SEGMENTS,
                dg.AssetKey("imported_segments"),
            ],  # imported segments are sorted too
            description="Flushed segments sorted by pk (stats task) and small ones merged with deleted rows "
            "removed (mix compaction): plans at meta/compaction/, one version-checked commit each.",
            group_name=LIFECYCLE_GROUP,
            kinds={"spark", "etcd"},
        ),
        dg.AssetSpec(
            GARBAGE_COLLECTION,
            deps=[COMPACTED_SEGMENTS],
            description="Orphan binlogs, dropped segments (files then meta) and log files below the "
            "checkpoint, removed after their tolerances.",
            group_name=LIFECYCLE_GROUP,
            kinds={"parquet"},
        ),
    ],
    check_specs=[CHECK_ROWS, CHECK_UNIQUE, CHECK_FILES],
)
def segment_lifecycle(context: dg.AssetExecutionContext, vchan: VchanResource) -> object:
    """One DataCoord lifecycle step: expire and clean plans, trigger, compact, garbage-collect
    (binlogs, log files, index builds and files), and delete the sort and index tasks of
    segments that are gone."""
    with vchan.open() as runtime:
        store, storage = runtime.store, runtime.storage
        report = lifecycle_step(
            runtime, gc_passes=[collect_indexes], sort_grace=runtime.settings.sort_leftover_after
        )
        pruned = prune_tasks(store)  # as the DataCoord's full scan: tasks of segments gone
        completed = [o.plan_id for o in report.outcomes if o.state is PlanState.COMPLETED]
        plans = _plans(store, completed)
        figures = storage_figures(store, storage)
        rows = check_rows_conserved(store, storage, plans)
        unique = check_unique_live_pks(store, storage)
        files = check_live_files_exist(store, storage)
    gc = report.gc
    context.log.info("lifecycle: %d planned, %d completed", len(report.planned), len(completed))
    yield from [
        dg.MaterializeResult(
            asset_key=COMPACTED_SEGMENTS,
            metadata=typed(
                {
                    "planned": len(report.planned),
                    "completed": len(completed),
                    "failed": len(report.outcomes) - len(completed),
                    "timed_out": len(report.timed_out),
                    "tasks_pruned": len(pruned),
                    "rows_in": sum(p.rows_in for p in plans),
                    "rows_out": sum(p.rows_out for p in plans),
                    **figures,
                }
            ),
        ),
        dg.MaterializeResult(
            asset_key=GARBAGE_COLLECTION,
            metadata=typed(
                {
                    "ran": gc is not None and not gc.paused_until,
                    "orphans_deleted": len(gc.orphans) if gc else 0,
                    "dropped_segments_deleted": len(gc.dropped_segments) if gc else 0,
                    "wal_files_deleted": len(gc.wal_files) if gc else 0,
                    "bytes_freed": gc.bytes if gc else 0,
                    "binlog_files": figures["binlog_files"],
                    "wal_bytes": figures["wal_bytes"],
                }
            ),
        ),
        check_result(CHECK_ROWS, rows),
        check_result(CHECK_UNIQUE, unique),
        check_result(CHECK_FILES, files),
    ]


lifecycle_job = dg.define_asset_job(
    "lifecycle",
    selection=dg.AssetSelection.assets(COMPACTED_SEGMENTS, GARBAGE_COLLECTION),
    executor_def=dg.in_process_executor,
    description="One segment lifecycle step: compaction plans, then garbage collection.",
)


@dg.sensor(job=lifecycle_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def lifecycle_sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
    """DataCoord automation: a lifecycle run every VCHAN_LIFECYCLE_INTERVAL (one at a time),
    unless a `vchan datacoord` process leads the election (it runs the same step)."""
    with vchan_env.open() as runtime:
        elsewhere = lifecycle_elsewhere(runtime.store)
    if elsewhere:
        return dg.SensorResult(skip_reason=elsewhere)
    interval = vchan_env.settings().lifecycle_interval
    last = float(context.cursor or 0)
    now = time.time()
    if now - last < interval:
        return dg.SensorResult(skip_reason=f"next lifecycle step in {interval - (now - last):.0f}s")
    return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"lifecycle-{int(now)}")], cursor=str(now))
