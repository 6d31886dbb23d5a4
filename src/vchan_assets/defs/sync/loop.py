"""The sync loop of a Dagster-hosted DataNode: one long-lived run per node, each sync one
set of materializations of that run (docs/dagster.md).

Why a loop and not a run per sync: a sync run waits for the daemon's sensor loop (a tick
every 5 s at best), the run queue, and a new run process with its own Spark session, so a
change took 8-10 s to reach its checkpoint (docs/dagster.md has the breakdown), and every
sync left one more run in the instance. The loop run keeps the node's Spark session warm
and polls its channels every `LOOP_POLL_SECONDS`; a channel whose sync policy fires is
synced at once under the node's channel lease (`VchanRuntime.sync`, the same call the sync
run makes), and the sync is reported as the three materializations (`binlogs`, `segments`,
`channel_checkpoints`, partition = vchannel, with the same metadata as a sync run) and the
four check evaluations, as events of the loop run. The assets' history keeps one entry
per sync; the run's history is one run per node per `VCHAN_DAGSTER_SYNC_LOOP` seconds.

The datanode sensor of the node requests the loop (`loop_run_request`, run key
`loop:{node}:{n}`) whenever the node has none in flight; dagster.yaml admits one per node
(tag `vchan/loop`). The loop ends, and its run succeeds, when its time is up (the sensor
starts the next) or when its node's session is gone (the node's sensor stopped, or a new
node took the slot: the channels move, and the lease fences off whatever was in flight).

The loop keeps its node's session alive too (every `KEEPALIVE_SECONDS`), as a DataNode
process does, unless the node's sensor was stopped: the daemon evaluates sensors one after
another on a few threads, and on a loaded machine a node sensor's ticks came 30-60 s apart,
longer than the session's TTL. The node then lost its session, its channels moved, and each
new node asked for a new loop run: a run process more to start on a machine already short
of CPU. While its loop runs, a node lives as long as the loop polls.
While a node has no loop in flight the sync sensor syncs its channels as runs, as it does
everywhere with VCHAN_DAGSTER_SYNC_LOOP=0.

Exactly once does not depend on the loop: each sync claims the channel under its lease
(`SyncTask`); a sync that lost the lease or was superseded by a watch or release run of
the same channel commits nothing, and the loop goes on with the next channel.
"""

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import dagster as dg
from dagster._core.scheduler.instigation import InstigatorStatus, InstigatorType
from dagster_pyspark import PySparkResource

from vchan_assets.datanode.sync import SyncResult
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.sync.assets import SyncConfig, previous_checkpoint, sync_results
from vchan_assets.defs.sync.jobs import LOOP_JOB, LOOP_TAG, NODE_TAG
from vchan_assets.defs.sync.sensor import busy_channels, dagster_nodes, plan_syncs
from vchan_assets.meta.errors import LeaseLostError, SyncSupersededError

log = logging.getLogger(__name__)

LOOP_POLL_SECONDS = 0.5  # between two looks at the node's channels when none needed a sync
KEEPALIVE_SECONDS = 2.0  # between two refreshes of the node's session lease (at most TTL/4)
SENSOR_STATE_SECONDS = 10.0  # between two looks at whether the node's sensor was stopped


class LoopConfig(dg.Config):
    """The node the loop syncs for, and how long it lives (VCHAN_DAGSTER_SYNC_LOOP)."""

    node_id: int
    session_lease: int = 0  # the node's session lease, kept alive by the loop too (0: not)
    seconds: float = 3600.0
    poll_seconds: float = LOOP_POLL_SECONDS


SyncEvent = dg.AssetMaterialization | dg.AssetCheckEvaluation


def sync_events(results: list[dg.MaterializeResult | dg.AssetCheckResult], vchannel: str) -> list[SyncEvent]:
    """The materializations and check results of one sync (`sync_results`, what a sync run
    returns) as events an op reports for the vchannel partition."""
    events: list[SyncEvent] = []
    for r in results:
        assert r.asset_key is not None  # sync_results names every asset
        if isinstance(r, dg.MaterializeResult):
            events.append(dg.AssetMaterialization(r.asset_key, partition=vchannel, metadata=r.metadata))
        else:
            assert r.check_name is not None
            events.append(
                dg.AssetCheckEvaluation(
                    asset_key=r.asset_key,
                    check_name=r.check_name,
                    passed=r.passed,
                    metadata=r.metadata,
                    description=r.description,
                    partition=vchannel,
                )
            )
    return events


class NodeSyncLoop:
    """The loop's body without Dagster's op around it: `step()` syncs every channel of the
    node whose sync policy fires, `ready()` returns the events of the syncs reported so far."""

    def __init__(
        self,
        runtime: VchanRuntime,
        instance: dg.DagsterInstance,
        node_id: int,
        session_lease: int = 0,
        keep_session: Callable[[], bool] = lambda: True,
    ) -> None:
        self.runtime = runtime
        self.instance = instance
        self.node_id = node_id
        self.session_lease = session_lease
        self.keep_session = keep_session  # False once the node's sensor was stopped
        self.kept_alive_at = float("-inf")
        self.previous: dict[str, int | None] = {}  # the checkpoint each channel's last sync reported
        self.syncs = 0
        self.skipped: list[str] = []  # why syncs committed nothing (lease moved, superseded)
        # A sync's report (its metadata and four checks, two of which read every binlog of the
        # channel) is made on this thread, in sync order, so the loop goes back to its channels
        # right after each commit: a change that lands meanwhile does not wait for the checks.
        self.reports = ThreadPoolExecutor(1, thread_name_prefix="sync reports")
        self.pending: deque[Future[list[SyncEvent]]] = deque()

    def alive(self) -> bool:
        """The node's session is still there (its sensor keeps it alive, and so does this
        loop, every KEEPALIVE_SECONDS, while `keep_session()`)."""
        now = time.monotonic()
        every = min(KEEPALIVE_SECONDS, self.runtime.settings.session_ttl / 4)
        if self.session_lease and now - self.kept_alive_at >= every and self.keep_session():
            self.kept_alive_at = now
            try:
                self.runtime.store.keepalive(self.session_lease)
            except Exception as exc:  # an expired lease is an error on some etcd versions
                log.info("keep-alive of node %s failed: %s", self.node_id, exc)
        return self.node_id in dagster_nodes(self.runtime)

    def step(self) -> int:
        """Sync every channel of the node whose sync policy fires; how many syncs committed
        (their reports come from `ready`)."""
        plans = plan_syncs(self.runtime, busy_channels(self.instance), nodes={self.node_id})
        synced = 0
        for plan in plans:
            vchannel, lease = plan.vchannel, plan.lease
            if vchannel not in self.previous:
                self.previous[vchannel] = previous_checkpoint(self.instance, vchannel)
            try:
                result = self.runtime.sync(vchannel, lease.lease_id)
            except (LeaseLostError, SyncSupersededError) as exc:
                self.skipped.append(f"{vchannel}: {exc}")
                continue
            config = SyncConfig(lease_id=lease.lease_id, node_id=self.node_id, reason="; ".join(plan.reasons))
            previous, self.previous[vchannel] = self.previous[vchannel], result.end.offset
            self.pending.append(self.reports.submit(self._report, result, previous, config))
            synced += 1
        self.syncs += synced
        return synced

    def _report(self, result: SyncResult, previous: int | None, config: SyncConfig) -> list[SyncEvent]:
        return sync_events(sync_results(self.runtime, result, previous, config), result.vchannel)

    def ready(self, wait: bool = False) -> list[SyncEvent]:
        """The events of the finished reports, in sync order (`wait`: of every report)."""
        events: list[SyncEvent] = []
        while self.pending and (wait or self.pending[0].done()):
            events += self.pending.popleft().result()
        return events

    def close(self) -> list[SyncEvent]:
        """The events of the reports still pending; no more syncs after this."""
        try:
            return self.ready(wait=True)
        finally:
            self.reports.shutdown()


class SensorState:
    """Whether the sensor that requested the loop (its node) was stopped in the UI or with
    `dagster sensor stop`, looked up at most every SENSOR_STATE_SECONDS."""

    def __init__(self, instance: dg.DagsterInstance, name: str) -> None:
        self.instance = instance
        self.name = name
        self.checked_at = float("-inf")
        self.stopped = False

    def not_stopped(self) -> bool:
        now = time.monotonic()
        if self.name and now - self.checked_at >= SENSOR_STATE_SECONDS:
            self.checked_at = now
            states = self.instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
            self.stopped = any(s.name == self.name and s.status == InstigatorStatus.STOPPED for s in states)
        return not self.stopped


@dg.op(name="node_sync_loop", out={}, tags={"kind": "spark"})
def node_sync_loop(
    context: dg.OpExecutionContext, config: LoopConfig, vchan: VchanResource, pyspark: PySparkResource
) -> Iterator[SyncEvent]:
    """Sync the node's channels as their sync policies fire, reporting each sync as
    materializations of binlogs, segments and channel_checkpoints, until the loop's time
    is up or the node's session is gone."""
    ends = time.monotonic() + config.seconds
    sensor = SensorState(context.instance, context.run.tags.get("dagster/sensor_name", ""))
    with vchan.open() as runtime:
        loop = NodeSyncLoop(
            runtime.with_spark(pyspark.spark_session),
            context.instance,
            config.node_id,
            config.session_lease,
            keep_session=sensor.not_stopped,
        )
        try:
            while True:  # one look at the channels at least, then until the time is up
                if not loop.alive():
                    context.log.info("node %s has no session any more: its sync loop ends", config.node_id)
                    break
                synced = loop.step()
                yield from loop.ready()
                for skipped in loop.skipped:
                    context.log.info("sync committed nothing: %s", skipped)
                loop.skipped.clear()
                if time.monotonic() >= ends:
                    break
                if not synced:
                    time.sleep(config.poll_seconds)
        finally:
            events = loop.close()
        yield from events
    context.log.info("node %s: %d syncs in this loop run", config.node_id, loop.syncs)


node_sync_loop_job = dg.GraphDefinition(name=LOOP_JOB, node_defs=[node_sync_loop]).to_job(
    executor_def=dg.in_process_executor,
    description="The sync loop of one Dagster-hosted DataNode: each sync a materialization of "
    "binlogs, segments and channel_checkpoints (docs/dagster.md).",
)


def loop_run_request(node_id: int, number: int, seconds: float, session_lease: int = 0) -> dg.RunRequest:
    """The `number`-th loop run of `node_id` (a stable run key: a re-evaluated tick
    requests it once)."""
    config = LoopConfig(node_id=node_id, session_lease=session_lease, seconds=seconds)
    return dg.RunRequest(
        run_key=f"loop:{node_id}:{number}",
        job_name=LOOP_JOB,
        run_config=dg.RunConfig(ops={"node_sync_loop": config}),
        tags={NODE_TAG: str(node_id), LOOP_TAG: str(node_id)},
    )


def loop_runs(
    instance: dg.DagsterInstance, node_id: int, statuses: list[dg.DagsterRunStatus] | None = None
) -> int:
    """How many loop runs of `node_id` the instance has (with one of `statuses`)."""
    return instance.get_runs_count(
        dg.RunsFilter(job_name=LOOP_JOB, tags={LOOP_TAG: str(node_id)}, statuses=statuses or [])
    )


def cancel_queued_loops_of_earlier_nodes(
    instance: dg.DagsterInstance, sensor_name: str, node_id: int
) -> list[str]:
    """Cancel the loop runs a node sensor requested for its earlier nodes (their sessions
    are gone) that are still queued: started, they would only find their node gone and end,
    after the seconds a run process takes to start. Their ids."""
    queued = instance.get_runs(
        dg.RunsFilter(
            job_name=LOOP_JOB,
            tags={"dagster/sensor_name": sensor_name},
            statuses=[dg.DagsterRunStatus.QUEUED],
        )
    )
    stale = [r for r in queued if r.tags.get(LOOP_TAG) != str(node_id)]
    for run in stale:  # what QueuedRunCoordinator.cancel_run does with a queued run
        instance.report_run_canceling(run, message=f"node {run.tags.get(LOOP_TAG)} is gone (now {node_id})")
        instance.report_run_canceled(run)
    return [r.run_id for r in stale]
