"""The persisted state of a vchannel as assets: `binlogs` -> `segments` -> `channel_checkpoints`.

The three assets are the three commit steps of one sync (invariant 1 of docs/architecture.md: files,
then segment meta, then the checkpoint), so they are materialized together by one
multi-asset, partitioned by vchannel, that runs the PySpark `SyncTask` through
dagster-pyspark's resource. Their lineage in the UI is the commit order.

Downstream, unpartitioned: `segment_table`, one Parquet table of every segment
(`{storage}/catalog/segments.parquet`) that the notebooks read, kept fresh by declarative
automation (defs/automation.py). The exactly-once checks of the sync are blocking.
"""

import time
from collections.abc import Callable, Collection
from dataclasses import asdict
from typing import Any

import dagster as dg
from dagster_pyspark import PySparkResource

from vchan_assets.datanode.channel import NodeContext
from vchan_assets.datanode.checks import CheckOutcome
from vchan_assets.datanode.node import release_channel
from vchan_assets.datanode.sync import SyncResult
from vchan_assets.defs.automation import CATALOG_FRESHNESS, catalog_condition
from vchan_assets.defs.checks import asset_checks, check_result, typed
from vchan_assets.defs.partitions import vchannels
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.meta.channelwatch import parse_watch_info
from vchan_assets.meta.errors import LeaseLostError, SyncSupersededError
from vchan_assets.model import WatchState, physical_ms

SYNC_GROUP = "vchannel_sync"


def _commit_step(
    key: str, description: str, kinds: set[str], after: dg.AssetSpec | None = None
) -> dg.AssetSpec:
    """One commit step of a sync, downstream of the step before it. Skippable: a run may
    end without materializing the steps (a release run whose lease moved on)."""
    deps = [after] if after is not None else []
    return dg.AssetSpec(
        key, deps=deps, description=description, group_name=SYNC_GROUP, kinds=kinds, skippable=True
    )


# The three commit steps, in commit order.
BINLOGS = _commit_step(
    "binlogs",
    "Insert, delta and stats logs of the vchannel in object storage (commit step 1).",
    {"spark", "parquet"},
)
SEGMENTS = _commit_step(
    "segments",
    "Segment meta in etcd pointing at the binlogs (commit step 2, lease-guarded).",
    {"etcd"},
    after=BINLOGS,
)
CHANNEL_CHECKPOINTS = _commit_step(
    "channel_checkpoints",
    "The vchannel's checkpoint in etcd: only forward, never past binlogs (step 3).",
    {"etcd"},
    after=SEGMENTS,
)

CHECK_LOG_ROWS, CHECK_UNIQUE_PKS = asset_checks(
    BINLOGS.key,
    blocking=True,
    binlog_rows_match_log="Insert binlog rows == Insert messages in the committed log range; delta log rows == "
    "Delete messages in it (deletes live in L0 delta logs, not applied to insert binlogs).",
    no_duplicate_pks="No primary key twice in the vchannel's insert binlogs.",
)
(CHECK_BINLOG_PATHS,) = asset_checks(
    SEGMENTS.key,
    blocking=True,
    binlog_paths_exist="Every binlog/delta/stats path in segment meta exists.",
)
(CHECK_MONOTONIC,) = asset_checks(
    CHANNEL_CHECKPOINTS.key,
    blocking=True,
    checkpoint_monotonic="The checkpoint is at or after the one of the previous materialization of this partition.",
)
# The four checks every sync evaluates (a sync run's, a sync loop's report).
SYNC_CHECKS = (CHECK_LOG_ROWS, CHECK_UNIQUE_PKS, CHECK_BINLOG_PATHS, CHECK_MONOTONIC)


class SyncConfig(dg.Config):
    """Which writer this run is: the lease id the sensor saw (0: the channel's current lease)."""

    lease_id: int = 0
    node_id: int = -1
    reason: str = ""
    release: bool = False  # a release run: final sync, then ReleaseSuccess on watch_key
    watch_key: str = ""


def sync_run_config(config: SyncConfig) -> dg.RunConfig:
    """The run config of one sync run, built from the typed config."""
    return dg.RunConfig(ops={"sync_vchannel": config})


def previous_checkpoint(instance: dg.DagsterInstance, vchannel: str) -> int | None:
    """The checkpoint offset the last materialization of the vchannel's checkpoint reported."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=CHANNEL_CHECKPOINTS.key, asset_partitions=[vchannel]), limit=1
    ).records
    if not records or records[0].asset_materialization is None:
        return None
    value = records[0].asset_materialization.metadata.get("checkpoint_offset")
    return int(str(value.value)) if value is not None else None


def sync_results(
    runtime: VchanRuntime,
    result: SyncResult,
    previous: int | None,
    config: SyncConfig,
    checks: Collection[dg.AssetCheckKey] | None = None,
) -> list[dg.MaterializeResult | dg.AssetCheckResult]:
    """The three materializations and the four checks of one sync (of them, those in
    `checks` if given: a run launched without some checks does not evaluate them)."""
    common: dict[str, Any] = {
        "position_range": f"({result.start.offset}, {result.end.offset}]",
        "start_offset": result.start.offset,
        "end_offset": result.end.offset,
        "lease_id": config.lease_id,
        "node_id": config.node_id,
        "reason": config.reason,
    }
    return [
        *_materializations(runtime, result, previous, common),
        *_checks(runtime, result, previous, checks),
    ]


def _materializations(
    runtime: VchanRuntime, result: SyncResult, previous: int | None, common: dict[str, Any]
) -> list[dg.MaterializeResult]:
    end = result.end
    head = runtime.status(result.vchannel).backlog.head
    lag_seconds = max(0.0, time.time() - physical_ms(end.timestamp) / 1000) if end.timestamp else 0.0
    segs = runtime.segments(result.vchannel)
    phases = asdict(result.phases) if result.phases else {}  # none when nothing was synced
    binlogs: dict[str, Any] = {
        "rows": result.rows,
        "deletes": result.deletes,
        "files": result.files,
        "bytes": result.bytes,
        "seconds": round(result.seconds, 3),
        **{f"seconds_{name}": round(v, 3) for name, v in phases.items()},
        "written_by": result.written_by,
        "skipped": result.skipped,
    }
    segments: dict[str, Any] = {
        "segments_touched": len(result.segments),
        "segments_flushed": len(result.flushed_segments),
        "segments_total": len(segs),
        "rows": sum(s.num_rows for s in segs if s.level.value != "L0"),
        "deletes": sum(b.entries for s in segs for b in s.deltalogs),
    }
    checkpoint: dict[str, Any] = {
        "checkpoint_offset": end.offset,
        "checkpoint_ts": end.timestamp,
        "previous_checkpoint_offset": previous if previous is not None else -1,
        "checkpoint_lag_messages": max(0, head.offset - end.offset) if head else 0,
        "checkpoint_lag_seconds": round(lag_seconds, 3),
    }
    return [
        dg.MaterializeResult(asset_key=spec.key, metadata=typed({**common, **metadata}))
        for spec, metadata in ((BINLOGS, binlogs), (SEGMENTS, segments), (CHANNEL_CHECKPOINTS, checkpoint))
    ]


def _checks(
    runtime: VchanRuntime,
    result: SyncResult,
    previous: int | None,
    selected: Collection[dg.AssetCheckKey] | None,
) -> list[dg.AssetCheckResult]:
    vchannel, end = result.vchannel, result.end
    monotonic = CheckOutcome(
        previous is None or end.offset >= previous,
        f"checkpoint {end.offset}, previous materialization {previous}",
        {"checkpoint_offset": end.offset, "previous_offset": -1 if previous is None else previous},
    )
    # Two of them read every binlog of the channel: only the selected ones are evaluated.
    outcomes: list[tuple[dg.AssetCheckSpec, Callable[[], CheckOutcome]]] = [
        (CHECK_LOG_ROWS, lambda: runtime.check_log_rows(vchannel)),
        (CHECK_UNIQUE_PKS, lambda: runtime.check_unique_pks(vchannel)),
        (CHECK_BINLOG_PATHS, lambda: runtime.check_binlog_paths(vchannel)),
        (CHECK_MONOTONIC, lambda: monotonic),
    ]
    return [
        check_result(spec, outcome())
        for spec, outcome in outcomes
        if selected is None or spec.key in selected
    ]


@dg.multi_asset(
    name="sync_vchannel",
    specs=[BINLOGS, SEGMENTS, CHANNEL_CHECKPOINTS],
    check_specs=list(SYNC_CHECKS),
    partitions_def=vchannels,
    # Subsettable so that a run which commits nothing (superseded, or a release whose lease
    # moved on) may end without its checks; a sync still commits all three steps or none.
    can_subset=True,
)
def sync_vchannel(
    context: dg.AssetExecutionContext, config: SyncConfig, vchan: VchanResource, pyspark: PySparkResource
) -> object:
    """Sync one vchannel from its checkpoint to its latest time tick under its channel lease."""
    vchannel = context.partition_key
    steps = {BINLOGS.key, SEGMENTS.key, CHANNEL_CHECKPOINTS.key}
    if set(context.selected_asset_keys) != steps:
        chosen = ", ".join(sorted(k.to_user_string() for k in context.selected_asset_keys))
        raise dg.Failure(
            f"a sync commits binlogs, segments and channel_checkpoints together; select all three "
            f"(this run selected {chosen})",
            allow_retries=False,
        )
    with vchan.open() as runtime:
        lease_id = config.lease_id
        if not lease_id:
            lease = runtime.store.read_lease(vchannel)  # one etcd read, not the channel's status
            if lease is None:
                raise dg.Failure(f"{vchannel} has no channel lease: no node watches it")
            lease_id = lease.lease_id
        previous = previous_checkpoint(context.instance, vchannel)
        try:
            result = runtime.with_spark(pyspark.spark_session).sync(vchannel, lease_id)
        except LeaseLostError as exc:
            # The channel moved to another writer: this run stops its work (no partial commit).
            if not config.release:
                raise dg.Failure(f"lease lost, sync of {vchannel} stopped: {exc}") from exc
            context.log.info("release of %s: no final sync, the lease moved on (%s)", vchannel, exc)
            _release(runtime, config)
            return
        except SyncSupersededError as exc:
            # Another sync of the channel under the same lease claimed it after this one began
            # (the node's sync loop, or the next run after this one was given up on): that one
            # commits the range, this one committed nothing. Not a failure: the channel is fine.
            context.log.warning("%s; nothing to report for this run", exc)
            return
        context.log.info(
            "%s: (%d, %d] %d rows, %d deletes, %d files %s",
            vchannel,
            result.start.offset,
            result.end.offset,
            result.rows,
            result.deletes,
            result.files,
            result.skipped,
        )
        config = config.model_copy(update={"lease_id": lease_id})
        yield from sync_results(runtime, result, previous, config, context.selected_asset_check_keys)
        if config.release:
            _release(runtime, config)


def _release(runtime: VchanRuntime, config: SyncConfig) -> None:
    """ToRelease -> ReleaseSuccess (the node's release_channel), if the key still says so."""
    if not config.watch_key:
        return  # a deleted watch info: nothing to answer
    found = runtime.store.get(config.watch_key)
    if found is None:
        return
    info = parse_watch_info(config.watch_key, found.value)
    if info.state is not WatchState.TO_RELEASE:
        return
    ctx = NodeContext(runtime, config.node_id, "spark")
    release_channel(ctx, config.watch_key, found.version, info)


@dg.asset(
    deps=[CHANNEL_CHECKPOINTS],
    group_name="catalog",
    kinds={"parquet"},
    automation_condition=catalog_condition(),  # after syncs whose exactly-once checks passed
    freshness_policy=CATALOG_FRESHNESS,
)
def segment_table(vchan: VchanResource) -> dg.MaterializeResult:
    """Every segment of every collection as one table, `{storage}/catalog/segments.parquet`:
    what the notebooks read."""
    with vchan.open() as runtime:
        path, table = runtime.catalog().write_segment_table()
    states = table.column("state").to_pylist()
    return dg.MaterializeResult(
        metadata=typed(
            {
                "path": path,
                "segments": table.num_rows,
                "rows": sum(table.column("num_rows").to_pylist()),
                "binlog_bytes": sum(table.column("size_bytes").to_pylist()),
                "flushed": states.count("Flushed"),
                "growing": states.count("Growing"),
                "dagster/row_count": table.num_rows,
            }
        )
    )
