"""DataNodes that live inside Dagster: one watch sensor per configured node slot.

How a node lives here (the design):

- **The sensor is the node.** Sensor `datanode_{slot}` hosts one DataNode. Its cursor
  (JSON) holds the node's id, the etcd lease of its session and the etcd revision of
  `channelwatch/{nodeID}/` it has seen. Each tick first refreshes the session lease
  (`store.keepalive`); the session (`session/datanode/{id}`, address `dagster:{slot}`)
  therefore lives exactly as long as the sensor keeps ticking. The daemon ticks a
  sensor every 5 s at best, so the session TTL is max(VCHAN_SESSION_TTL, 60 s). Stop the sensor (UI,
  `dagster sensor stop`, GraphQL `stopSensor`, or the daemon dying) and the session
  expires after that TTL: the coordinator sensor reassigns its channels with
  new leases, which fences off any sync run of the dead node still in flight
  (LeaseLostError, nothing committed). Killing a node is that: a real, testable action.
- **A dead session is never revived.** If the lease is gone when the sensor ticks
  (it was stopped for longer than the TTL), the tick registers a new node with a new,
  never-reused id (Milvus' MEP 7: restarting a node is the same as starting it). So does a tick
  that finds its node STOPPING (its sync loop run was interrupted, and the node is leaving:
  defs/sync/loop.py): the sensor never refreshes a STOPPING session nor writes it HEALTHY.
- **Watch handling is the node's step functions**, the same ones the standalone
  `vchan datanode` process calls: `parse_watch_info`, `watch_channel` (ToWatch ->
  lease check, recovery info, CAS WatchSuccess/WatchFailure) runs in the tick; the
  channel's work is then Dagster runs: ToWatch -> add the vchannel partition and
  request the first sync run; ToRelease or delete -> request the release run (a final
  sync under the node's lease if it still holds it, then CAS ReleaseSuccess).
- **Cursor = etcd revision** via `meta.watch.poll_changes`: without a cursor, or when
  it was compacted away, the tick relists the whole prefix (invariant 5).
- **Run keys are stable**: `watch:{node}:{vchannel}:{lease}` and
  `release:{node}:{vchannel}:{mod_revision}`; a tick re-evaluated after a crash
  requests nothing twice.
- **Syncs while watching come from the node's sync loop** (defs/sync/loop.py): one
  long-lived run per node, requested by this sensor whenever the node has none in flight
  (run key `loop:{node}:{n}`), each sync reported as materializations of that run. Without
  a loop in flight (VCHAN_DAGSTER_SYNC_LOOP=0, or between two loop runs) the sync sensor
  (defs/sync/sensor.py) requests a run per sync. Both sync only channels whose lease
  belongs to a live Dagster-hosted node (session address `dagster:*`), so a standalone
  `vchan datanode` process and Dagster never write one channel together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import dagster as dg

from vchan_assets import __version__
from vchan_assets.datanode.channel import NodeContext
from vchan_assets.datanode.node import is_end_state, watch_channel
from vchan_assets.defs.cluster.cursor import SensorCursor
from vchan_assets.defs.partitions import VCHANNELS, vchannels
from vchan_assets.defs.resources import VchanEnvResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.sync.assets import SyncConfig, sync_run_config
from vchan_assets.defs.sync.jobs import CHANNEL_TAG, DAGSTER_ADDRESS, NODE_TAG, REASON_TAG, sync_job
from vchan_assets.defs.sync.loop import (
    cancel_queued_loops_of_earlier_nodes,
    loop_run_request,
    loop_runs,
    node_sync_loop_job,
)
from vchan_assets.defs.sync.sensor import IN_FLIGHT
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.channelwatch import parse_watch_info
from vchan_assets.meta.errors import CasConflictError, MalformedValueError
from vchan_assets.meta.watch import Changes, EventKind, poll_changes
from vchan_assets.model import NodeSession, SessionState, WatchState

log = logging.getLogger(__name__)

WATCH_SENSOR_INTERVAL = 1
# dagster-daemon evaluates sensors at most every 5 s (MIN_INTERVAL_LOOP_TIME in
# dagster/_daemon/sensor.py), and on a loaded machine a node sensor's ticks come much
# further apart, so a sensor-hosted node's session must outlive several ticks: its TTL is
# at least this (VCHAN_SESSION_TTL if larger; docs/dagster.md, "The node's session").
SESSION_TTL_FLOOR = 60.0


@dataclass
class NodeCursor(SensorCursor, afresh="starting a new node"):
    node_id: int = 0
    session_lease: int = 0
    revision: int = 0


@dataclass
class WatchRequest:
    """A run the node asks for: the first sync after a watch, or a release."""

    vchannel: str
    run_key: str
    lease_id: int
    release: bool = False
    watch_key: str = ""


@dataclass
class NodeTick:
    cursor: NodeCursor
    new_session: bool = False
    relisted: str = ""  # why, if the tick relisted the prefix
    partitions: list[str] = field(default_factory=list)
    requests: list[WatchRequest] = field(default_factory=list)
    watched: list[tuple[str, str]] = field(default_factory=list)  # (vchannel, state written)
    skipped: list[str] = field(default_factory=list)


class DagsterDataNode:
    """One tick of a Dagster-hosted DataNode (no Dagster import needed to use it)."""

    def __init__(self, runtime: VchanRuntime, slot: str, min_session_ttl: float = SESSION_TTL_FLOOR) -> None:
        self.runtime = runtime
        self.store = runtime.store
        self.slot = slot
        self.session_ttl = max(runtime.settings.session_ttl, min_session_ttl)

    def ensure_session(self, cursor: NodeCursor) -> tuple[NodeCursor, bool]:
        """Refresh the node's session lease; register a new node if it is gone, or STOPPING
        (its loop run was interrupted and it is leaving: never refreshed, never HEALTHY again)."""
        if cursor.node_id and cursor.session_lease:
            found = self.store.get_model(self.store.keys.datanode_session(cursor.node_id), NodeSession)
            if found is not None and found.model.state is SessionState.STOPPING:
                log.warning(
                    "datanode %s (slot %s) is STOPPING: starting a new node", cursor.node_id, self.slot
                )
            else:
                try:
                    alive = self.store.keepalive(cursor.session_lease) > 0
                except Exception as exc:  # an unknown lease is an error on some etcd versions
                    log.info("keep-alive of node %s failed: %s", cursor.node_id, exc)
                    alive = False
                if alive and found is not None:
                    return cursor, False
                log.warning(
                    "datanode %s (slot %s) lost its session: starting a new node", cursor.node_id, self.slot
                )
        node_id = IdAllocator(self.store, batch=1).alloc()
        lease = self.store.grant(self.session_ttl)
        now = time.time()
        record = NodeSession(
            node_id, f"{DAGSTER_ADDRESS}{self.slot}", __version__, now, SessionState.HEALTHY, now
        )
        self.store.cas(self.store.keys.datanode_session(node_id), 0, record, lease=lease)
        log.info("datanode %s registered for sensor slot %s (lease %s)", node_id, self.slot, lease)
        return NodeCursor(node_id, lease, 0), True

    def tick(self, cursor: NodeCursor) -> NodeTick:
        cursor, new = self.ensure_session(cursor)
        ctx = NodeContext(self.runtime, cursor.node_id, "spark")
        prefix = self.store.keys.channel_watch.under(cursor.node_id)
        changes = poll_changes(self.store, prefix, cursor.revision or None)
        out = NodeTick(NodeCursor(cursor.node_id, cursor.session_lease, changes.revision), new_session=new)
        out.relisted = changes.reason if changes.relisted else ""
        for key, change in sorted(latest_changes(changes).items()):
            self.handle(ctx, out, key, change)
        return out

    def handle(self, ctx: NodeContext, out: NodeTick, key: str, change: KeyChange) -> None:
        """One watch key's latest change: watch it now, or ask for the run it needs."""
        node_id = out.cursor.node_id
        vchannel = key.rsplit("/", 1)[-1]
        release_key = f"release:{node_id}:{vchannel}:{change.mod_revision}"
        if change.kind is EventKind.DELETE:
            out.requests.append(WatchRequest(vchannel, release_key, 0, release=True))
            return
        try:
            info = parse_watch_info(key, change.value)
        except MalformedValueError as exc:
            log.error("datanode %s: skipping malformed watch info: %s", node_id, exc)
            out.skipped.append(key)
            return
        lease_id = info.lease_id or 0
        if info.state is WatchState.TO_RELEASE:
            out.requests.append(WatchRequest(vchannel, release_key, lease_id, release=True, watch_key=key))
        elif info.state is WatchState.WATCH_SUCCESS:
            out.partitions.append(vchannel)  # relist: make sure the partition exists
        elif info.state is WatchState.TO_WATCH:
            try:
                result = watch_channel(ctx, key, change.version, info)
            except CasConflictError:
                out.skipped.append(key)  # the coordinator moved on meanwhile
                return
            out.watched.append((vchannel, result.state.value))
            if result.state is WatchState.WATCH_SUCCESS:
                out.partitions.append(vchannel)
                out.requests.append(
                    WatchRequest(vchannel, f"watch:{node_id}:{vchannel}:{lease_id}", lease_id)
                )
        elif not is_end_state(info.state):
            out.skipped.append(key)


@dataclass(frozen=True)
class KeyChange:
    kind: EventKind
    version: int
    value: bytes
    mod_revision: int


def latest_changes(changes: Changes) -> dict[str, KeyChange]:
    """The last change per key: the relisted snapshot first, then the events after it."""
    latest: dict[str, KeyChange] = {}
    if changes.snapshot is not None:
        for kv in changes.snapshot.items:
            latest[kv.key] = KeyChange(EventKind.PUT, kv.version, kv.value, kv.mod_revision)
    for event in changes.events:
        latest[event.key] = KeyChange(event.kind, event.version, event.value, event.mod_revision)
    return latest


def watch_run_request(node_id: int, req: WatchRequest) -> dg.RunRequest:
    reason = "release" if req.release else "watch"
    config = SyncConfig(
        lease_id=req.lease_id, node_id=node_id, reason=reason, release=req.release, watch_key=req.watch_key
    )
    return dg.RunRequest(
        run_key=req.run_key,
        job_name=sync_job.name,
        partition_key=req.vchannel,
        run_config=sync_run_config(config),
        tags={CHANNEL_TAG: req.vchannel, NODE_TAG: str(node_id), REASON_TAG: reason},
    )


def datanode_sensor(slot: str, min_session_ttl: float = SESSION_TTL_FLOOR) -> dg.SensorDefinition:
    """The watch sensor of the DataNode hosted in sensor slot `slot`."""
    name = f"datanode_{slot}"

    @dg.sensor(
        name=name,
        jobs=[sync_job, node_sync_loop_job],
        minimum_interval_seconds=WATCH_SENSOR_INTERVAL,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"DataNode slot {slot}: keeps the node's session alive, watches channelwatch/<node>/.",
    )
    def _sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
        with vchan_env.open() as runtime:
            tick = DagsterDataNode(runtime, slot, min_session_ttl).tick(NodeCursor.parse(context.cursor))
            loop_seconds = runtime.settings.dagster_sync_loop
        if tick.relisted:
            context.log.info("node %s relisted its watch prefix: %s", tick.cursor.node_id, tick.relisted)
        known = set(context.instance.get_dynamic_partitions(VCHANNELS))
        missing = sorted(set(tick.partitions) - known)
        requests = [watch_run_request(tick.cursor.node_id, r) for r in tick.requests]
        node_id = tick.cursor.node_id
        if loop_seconds and not loop_runs(context.instance, node_id, IN_FLIGHT):
            number = loop_runs(context.instance, node_id)
            requests.append(loop_run_request(node_id, number, loop_seconds, tick.cursor.session_lease))
        if tick.new_session and (
            stale := cancel_queued_loops_of_earlier_nodes(context.instance, name, node_id)
        ):
            context.log.info(
                "node %s cancelled the queued loop runs of its earlier nodes: %s", node_id, stale
            )
        for r in tick.requests:
            if r.vchannel not in known and r.vchannel not in missing:
                missing.append(r.vchannel)
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[vchannels.build_add_request(missing)] if missing else [],
            cursor=tick.cursor.dump(),
            skip_reason=None if requests else f"node {tick.cursor.node_id}: no watch changes",
        )

    return _sensor
