"""The segment lifecycle as assets downstream of `segments`: `compacted_segments` (sort
and mix compaction plans run by the DataCoord lifecycle step) and `garbage_collection`
(orphans, dropped segments, old log files), materialized together by one step, with
checks, and a sensor that runs the step every VCHAN_LIFECYCLE_INTERVAL. The step is the
same one the `vchan datacoord` process runs (lifecycle/step.py)."""

import time

import dagster as dg

from vchan_assets.defs.checks import check_result
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.sync.assets import SEGMENTS
from vchan_assets.lifecycle.checks import (
    check_live_files_exist,
    check_rows_conserved,
    check_unique_live_pks,
    storage_figures,
)
from vchan_assets.lifecycle.plans import CompactionPlan, PlanState
from vchan_assets.lifecycle.step import lifecycle_step

COMPACTED_SEGMENTS = dg.AssetKey("compacted_segments")
GARBAGE_COLLECTION = dg.AssetKey("garbage_collection")
LIFECYCLE_GROUP = "segment_lifecycle"

CHECK_ROWS = "rows_conserved"
CHECK_UNIQUE = "no_pk_in_two_live_segments"
CHECK_FILES = "live_meta_files_exist"

LIFECYCLE_CHECKS = [
    dg.AssetCheckSpec(
        CHECK_ROWS,
        asset=COMPACTED_SEGMENTS,
        description="Per compaction of the step: rows in = rows out + rows its deletes removed (recomputed).",
    ),
    dg.AssetCheckSpec(
        CHECK_UNIQUE,
        asset=COMPACTED_SEGMENTS,
        description="No primary key in two live segments of a vchannel.",
    ),
    dg.AssetCheckSpec(
        CHECK_FILES,
        asset=GARBAGE_COLLECTION,
        description="Every file named by the meta of a live segment exists after the GC pass.",
    ),
]


@dg.multi_asset(
    name="segment_lifecycle",
    specs=[
        dg.AssetSpec(
            COMPACTED_SEGMENTS,
            deps=[SEGMENTS, dg.AssetKey("imported_segments")],  # imported segments are sorted too
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
    check_specs=LIFECYCLE_CHECKS,
)
def segment_lifecycle(context: dg.AssetExecutionContext, vchan: VchanResource) -> object:
    """One DataCoord lifecycle step: expire and clean plans, trigger, compact, garbage-collect."""
    with vchan.open() as runtime:
        store, storage = runtime.store, runtime.storage
        report = lifecycle_step(store, storage, runtime.settings)
        completed = [o.plan_id for o in report.outcomes if o.state is PlanState.COMPLETED]
        plans = [
            found.model
            for pid in completed
            if (found := store.get_model(store.keys.compaction_plan(pid), CompactionPlan)) is not None
        ]
        figures = storage_figures(store, storage)
        rows = check_rows_conserved(store, storage, plans)
        unique = check_unique_live_pks(store, storage)
        files = check_live_files_exist(store, storage)
    gc = report.gc
    context.log.info("lifecycle: %d planned, %d completed", len(report.planned), len(completed))
    yield from [
        dg.MaterializeResult(
            asset_key=COMPACTED_SEGMENTS,
            metadata={
                "planned": len(report.planned),
                "completed": len(completed),
                "failed": len(report.outcomes) - len(completed),
                "timed_out": len(report.timed_out),
                "rows_in": sum(p.rows_in for p in plans),
                "rows_out": sum(p.rows_out for p in plans),
                **figures,
            },
        ),
        dg.MaterializeResult(
            asset_key=GARBAGE_COLLECTION,
            metadata={
                "ran": gc is not None and not gc.paused_until,
                "orphans_deleted": len(gc.orphans) if gc else 0,
                "dropped_segments_deleted": len(gc.dropped_segments) if gc else 0,
                "wal_files_deleted": len(gc.wal_files) if gc else 0,
                "bytes_freed": gc.bytes if gc else 0,
                "binlog_files": figures["binlog_files"],
                "wal_bytes": figures["wal_bytes"],
            },
        ),
        check_result(CHECK_ROWS, COMPACTED_SEGMENTS, rows),
        check_result(CHECK_UNIQUE, COMPACTED_SEGMENTS, unique),
        check_result(CHECK_FILES, GARBAGE_COLLECTION, files),
    ]


lifecycle_job = dg.define_asset_job(
    "lifecycle",
    selection=dg.AssetSelection.assets(COMPACTED_SEGMENTS, GARBAGE_COLLECTION),
    executor_def=dg.in_process_executor,
    description="One segment lifecycle step: compaction plans, then garbage collection.",
)


@dg.sensor(job=lifecycle_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def lifecycle_sensor(context: dg.SensorEvaluationContext, vchan: VchanResource) -> dg.SensorResult:
    """DataCoord automation: a lifecycle run every VCHAN_LIFECYCLE_INTERVAL (one at a time)."""
    interval = vchan.settings().lifecycle_interval
    last = float(context.cursor or 0)
    now = time.time()
    if now - last < interval:
        return dg.SensorResult(skip_reason=f"next lifecycle step in {interval - (now - last):.0f}s")
    return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"lifecycle-{int(now)}")], cursor=str(now))
