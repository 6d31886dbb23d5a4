"""The sync sensor: a sync run for a vchannel partition when a sync policy fires.

Only channels owned by a Dagster-hosted DataNode (datanodes.py) that has no sync loop run
in flight (sync/loop.py; none at all with VCHAN_DAGSTER_SYNC_LOOP=0) are synced here: the
run commits under that node's channel lease, as the node. `plan_syncs` is also the loop's
question "which of my channels need a sync now".

Each tick reads, per vchannel that has a channel lease (some node owns it), the
backlog between the checkpoint and the log head and asks `datanode.policies` whether
to sync (buffered size, age of the oldest unsynced row, sealed segments, flush
timestamp). The run key names the lease and the backlog it was requested for
(`sync:{vchannel}:{lease}:{checkpoint}:{head}:{sealed}`), so a re-evaluated tick
requests nothing twice; a channel that already has a sync queued or running is left
alone (the next tick after it finishes sees what is left).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import dagster as dg

from vchan_assets.defs.partitions import VCHANNELS, retry_key, vchannels
from vchan_assets.defs.resources import VchanEnvResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.sync.assets import SyncConfig, sync_run_config
from vchan_assets.defs.sync.jobs import (
    CHANNEL_TAG,
    DAGSTER_ADDRESS,
    LOOP_JOB,
    LOOP_TAG,
    NODE_TAG,
    REASON_TAG,
    sync_job,
)
from vchan_assets.model import ChannelLease, ChannelWatchInfo, NodeSession, SessionState, WatchState

SYNC_SENSOR_INTERVAL = 1  # seconds: the latency budget of a change is ~10 s
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


@dataclass(frozen=True)
class SyncPlan:
    vchannel: str
    lease: ChannelLease  # the writer the sync runs as
    reasons: tuple[str, ...]
    run_key: str


def dagster_nodes(runtime: VchanRuntime) -> set[int]:
    """Live DataNodes hosted by Dagster sensors (session address `dagster:*`), except those
    STOPPING: a node whose loop run was interrupted is leaving, nothing syncs as it any more."""
    found, _ = runtime.store.list_models(
        runtime.store.keys.datanode_session.prefix, NodeSession, skip_malformed=True
    )
    return {
        d.model.node_id
        for d in found
        if d.model.address.startswith(DAGSTER_ADDRESS) and d.model.state is not SessionState.STOPPING
    }


def watching(runtime: VchanRuntime, node_id: int, vchannel: str) -> bool:
    found = runtime.store.get_model(runtime.store.keys.channel_watch(node_id, vchannel), ChannelWatchInfo)
    return found is not None and found.model.state is WatchState.WATCH_SUCCESS


def plan_syncs(
    runtime: VchanRuntime, now: float | None = None, nodes: set[int] | None = None
) -> list[SyncPlan]:
    """The channels a sync policy fires for: those whose lease belongs to a live
    Dagster-hosted node (one of `nodes`, if given) that watches them (WatchSuccess). It
    reads etcd only; `not_busy` drops those a sync run is already on."""
    plans = []
    live = dagster_nodes(runtime)
    nodes = live if nodes is None else live & nodes
    for vchannel, info in sorted(runtime.vchannels().items()):
        lease = runtime.store.read_lease(vchannel)
        if lease is None or lease.node_id not in nodes:
            continue  # nobody owns it, or a standalone `vchan datanode` or another node does
        status = runtime.status(vchannel, info)
        lease = status.lease
        if lease is None or lease.node_id not in nodes:
            continue  # it moved meanwhile
        if not watching(runtime, lease.node_id, vchannel):
            continue
        reasons = runtime.sync_reasons(status, now)
        if not reasons:
            continue
        b = status.backlog
        head = b.head.offset if b.head else -1
        key = f"sync:{vchannel}:{lease.lease_id}:{b.checkpoint.offset}:{head}:{b.sealed_segments}"
        plans.append(SyncPlan(vchannel, lease, tuple(reasons), key))
    return plans


def busy_channels(instance: dg.DagsterInstance) -> set[str]:
    records = instance.get_run_records(dg.RunsFilter(job_name=sync_job.name, statuses=IN_FLIGHT))
    return {r.dagster_run.tags[CHANNEL_TAG] for r in records if CHANNEL_TAG in r.dagster_run.tags}


def not_busy(instance: dg.DagsterInstance, plans: list[SyncPlan]) -> list[SyncPlan]:
    """`plans` less the channels a sync run is in flight for. Dagster's runs are asked only
    when there is a plan: most looks of an idle node's loop (twice a second) and most sync
    sensor ticks have none, and then read etcd alone."""
    if not plans:
        return plans
    busy = busy_channels(instance)
    return [p for p in plans if p.vchannel not in busy]


def looping_nodes(instance: dg.DagsterInstance) -> set[int]:
    """The nodes whose sync loop run (sync/loop.py) is running: their channels are its. A
    loop still queued or starting (seconds; on a loaded machine minutes) syncs nothing yet,
    so until it runs this sensor serves its node's channels with runs."""
    running = dg.RunsFilter(job_name=LOOP_JOB, statuses=[dg.DagsterRunStatus.STARTED])
    records = instance.get_run_records(running)
    return {int(r.dagster_run.tags[LOOP_TAG]) for r in records if LOOP_TAG in r.dagster_run.tags}


def sync_run_request(plan: SyncPlan) -> dg.RunRequest:
    lease = plan.lease
    config = SyncConfig(lease_id=lease.lease_id, node_id=lease.node_id, reason="; ".join(plan.reasons))
    return dg.RunRequest(
        run_key=plan.run_key,
        partition_key=plan.vchannel,
        run_config=sync_run_config(config),
        tags={CHANNEL_TAG: plan.vchannel, NODE_TAG: str(lease.node_id), REASON_TAG: plan.reasons[0][:60]},
    )


@dg.sensor(
    job=sync_job,
    minimum_interval_seconds=SYNC_SENSOR_INTERVAL,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def sync_sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
    """Request a sync of a vchannel partition when a sync policy fires."""
    with vchan_env.open() as runtime:
        plans = not_busy(context.instance, plan_syncs(runtime))
    if plans:
        looping = looping_nodes(context.instance)
        plans = [p for p in plans if p.lease.node_id not in looping]
    plans = [replace(p, run_key=retry_key(context.instance, p.run_key)) for p in plans]
    known = set(context.instance.get_dynamic_partitions(VCHANNELS)) if plans else set()
    missing = sorted({p.vchannel for p in plans} - known)
    return dg.SensorResult(
        run_requests=[sync_run_request(p) for p in plans],
        dynamic_partitions_requests=[vchannels.build_add_request(missing)] if missing else [],
        skip_reason=None if plans else "no sync policy fired",
    )
