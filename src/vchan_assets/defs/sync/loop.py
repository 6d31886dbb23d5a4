"""The sync loop of a Dagster-hosted DataNode: one long-lived run per node, each sync one
set of materializations of that run. Why a loop rather than a run per sync, and how its
session and graceful stop came to be as they are: docs/dagster.md.

- **Requested** by the node's datanode sensor (`loop_run_request`, run key
  `loop:{node}:{n}`) whenever the node has none in flight; dagster.yaml admits one per node
  (tag `vchan/loop`). While a node has no loop in flight the sync sensor syncs its channels
  as runs, as it does everywhere with VCHAN_DAGSTER_SYNC_LOOP=0.
- **Work**: the run keeps the node's Spark session and polls its channels every
  `LOOP_POLL_SECONDS`; a channel whose sync policy fires is synced at once under the node's
  channel lease (`VchanRuntime.sync`, the call a sync run makes), on a thread of the loop,
  and reported as events of the loop run: the three materializations (`binlogs`,
  `segments`, `channel_checkpoints`, partition = vchannel, with a sync run's metadata) and
  the four check evaluations.
- **Session**: the loop refreshes its node's session lease every `KEEPALIVE_SECONDS`, as a
  DataNode process does, unless the node's sensor was stopped (looked up every
  `SENSOR_STATE_SECONDS`).
- **End**: the run succeeds when its `VCHAN_DAGSTER_SYNC_LOOP` seconds are up (the sensor
  starts the next) or its node's session is gone (the channels move, and the lease fences
  off whatever was in flight).
- **Graceful stop**: interrupted (SIGTERM or SIGINT of its run worker), the node leaves as a
  `vchan datanode` does on SIGTERM (`NodeSyncLoop.leave`): STOPPING, the sync in flight gets
  `LEAVE_GRACE_SECONDS`, then the session lease is revoked. It leaves from the op's
  `DagsterExecutionInterruptedError` and from the teardown of `AtTeardown`, whichever comes
  first, since Dagster may raise the signal in its own code. A signal never cuts a sync in
  half: syncs run on a thread of the loop.
- **Exactly once** does not depend on the loop: each sync claims the channel under its lease
  (`SyncTask`); a sync that lost the lease or was superseded by a watch or release run of
  the same channel commits nothing, and the loop goes on with the next channel.
"""

import contextlib
import faulthandler
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import dagster as dg
from dagster._core.scheduler.instigation import InstigatorStatus, InstigatorType
from dagster_pyspark import PySparkResource
from pydantic import PrivateAttr

from vchan_assets.datanode.sync import SyncResult
from vchan_assets.defs.checks import ReportedEvent, reported_events
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.sync.assets import SyncConfig, previous_checkpoint, sync_results
from vchan_assets.defs.sync.jobs import LOOP_JOB, LOOP_TAG, NODE_TAG
from vchan_assets.defs.sync.sensor import busy_channels, not_busy, plan_syncs
from vchan_assets.deploy.spark_connect import drop_connect_session
from vchan_assets.meta.errors import LeaseLostError, MetaError, SyncSupersededError
from vchan_assets.model import NodeSession, SessionState

log = logging.getLogger(__name__)
T = TypeVar("T")

LOOP_RUNNING = "sync loop running"  # the loop run's log line once it syncs (sessions up)
LOOP_POLL_SECONDS = 0.5  # between two looks at the node's channels when none needed a sync
KEEPALIVE_SECONDS = 2.0  # between two refreshes of the node's session lease (at most TTL/4)
SENSOR_STATE_SECONDS = 10.0  # between two looks at whether the node's sensor was stopped
# How long a leaving loop waits for its sync in flight before it revokes its session: a
# short sync commits (or is refused by the new lease), a long one is abandoned. `vchan down`
# SIGKILLs the rest of a process group 3 s after its leader exited (deploy/service.py).
LEAVE_GRACE_SECONDS = 2.0
# What Dagster raises in the op when the run worker is signalled (GeneratorExit: the op's
# generator is closed after the signal was raised outside it).
INTERRUPTS = (dg.DagsterExecutionInterruptedError, KeyboardInterrupt, GeneratorExit)
# A look at the channels (and the syncs it starts) slower than this is logged with its parts;
# one that has not ended after STUCK_SECONDS has every thread's stack written to the run's
# stderr (its compute log), again every STUCK_SECONDS while it lasts.
SLOW_STEP_SECONDS = 30.0
STUCK_SECONDS = 120.0


class LoopConfig(dg.Config):
    """The node the loop syncs for, and how long it lives (VCHAN_DAGSTER_SYNC_LOOP)."""

    node_id: int
    session_lease: int = 0  # the node's session lease, kept alive by the loop too (0: not)
    seconds: float = 3600.0
    poll_seconds: float = LOOP_POLL_SECONDS


class DaemonWorker:
    """One daemon thread that runs the calls submitted to it in order: a one-thread
    executor that the process's exit does not wait for. Python joins the threads of every
    `ThreadPoolExecutor` at exit, so a report or an abandoned sync stuck in an etcd or Spark
    call kept a leaving loop's run worker alive long after its node had left; what such a
    call would have done is dropped by `leave` (reports) or fenced by the channel lease
    (a sync), as when the process is killed."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the caller's to see, through its future
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more calls after those queued (`cancel_futures`: those not started are
        cancelled); `wait`: until the thread has run them."""
        while cancel_futures:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)
        if wait:
            self._thread.join()


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
        self.reports = DaemonWorker("sync reports")
        self.pending: deque[Future[list[ReportedEvent]]] = deque()
        # Each sync runs on this thread while the op's thread waits for it: a signal (raised
        # in the op's thread) interrupts the wait, not the sync (`leave`).
        self.syncer = DaemonWorker("node sync")
        self.in_flight: Future[SyncResult] | None = None
        self.closed = False

    def alive(self) -> bool:
        """The node's session is still there and not STOPPING (its sensor keeps it alive,
        and so does this loop, every KEEPALIVE_SECONDS, while `keep_session()`)."""
        store = self.runtime.store  # this node's session key only, not every session
        found = store.get_model(store.keys.datanode_session(self.node_id), NodeSession)
        live = found is not None and found.model.state is not SessionState.STOPPING
        now = time.monotonic()
        every = min(KEEPALIVE_SECONDS, self.runtime.settings.session_ttl / 4)
        if live and self.session_lease and now - self.kept_alive_at >= every and self.keep_session():
            self.kept_alive_at = now
            try:
                self.runtime.store.keepalive(self.session_lease)
            except Exception as exc:  # an expired lease is an error on some etcd versions
                log.info("keep-alive of node %s failed: %s", self.node_id, exc)
        return live

    def step(self) -> int:
        """Sync every channel of the node whose sync policy fires; how many syncs committed
        (their reports come from `ready`)."""
        plans = not_busy(self.instance, plan_syncs(self.runtime, nodes={self.node_id}))
        synced = 0
        for i, plan in enumerate(plans):
            vchannel, lease = plan.vchannel, plan.lease
            if i and vchannel in busy_channels(self.instance):
                # A sync run of it was requested while this loop synced the channels before
                # (a sensor tick begun before the loop started): of two syncs at once, one
                # would commit nothing (SyncSupersededError).
                continue
            if vchannel not in self.previous:
                self.previous[vchannel] = previous_checkpoint(self.instance, vchannel)
            self.in_flight = self.syncer.submit(self.runtime.sync, vchannel, lease.lease_id)
            try:
                result = self.in_flight.result()
            except (LeaseLostError, SyncSupersededError) as exc:
                self.skipped.append(f"{vchannel}: {exc}")
                continue
            config = SyncConfig(lease_id=lease.lease_id, node_id=self.node_id, reason="; ".join(plan.reasons))
            previous, self.previous[vchannel] = self.previous[vchannel], result.end.offset
            self.pending.append(self.reports.submit(self._report, result, previous, config))
            synced += 1
        self.syncs += synced
        return synced

    def _report(self, result: SyncResult, previous: int | None, config: SyncConfig) -> list[ReportedEvent]:
        return reported_events(sync_results(self.runtime, result, previous, config), result.vchannel)

    def ready(self, wait: bool = False) -> list[ReportedEvent]:
        """The events of the finished reports, in sync order (`wait`: of every report)."""
        events: list[ReportedEvent] = []
        while self.pending and (wait or self.pending[0].done()):
            events += self.pending.popleft().result()
        return events

    def close(self) -> list[ReportedEvent]:
        """The events of the reports still pending; no more syncs after this."""
        if self.closed:
            return []
        self.closed = True
        try:
            return self.ready(wait=True)
        finally:
            self.reports.shutdown()
            self.syncer.shutdown()

    def leave(self, why: str) -> str:
        """Graceful stop of the node (its loop's run was interrupted), once: STOPPING in its
        session (the coordinator moves its channels at once), the sync in flight gets
        LEAVE_GRACE_SECONDS, then the session lease is revoked (the session is gone at once,
        not after its TTL). Pending reports are dropped: the run cannot report them any more.
        What it did, for the run's log ("" if the loop had ended already)."""
        if self.closed:
            return ""
        self.closed = True
        started = time.monotonic()
        self.reports.shutdown(wait=False, cancel_futures=True)
        self.pending.clear()
        store = self.runtime.store
        key = store.keys.datanode_session(self.node_id)
        gone, lease = False, self.session_lease
        try:
            found = store.get_model(key, NodeSession)
            gone = found is None
            if found is not None:
                lease = found.kv.lease or self.session_lease
                stopping = found.model.entered(SessionState.STOPPING, reason=why)
                store.cas(key, found.kv.version, stopping, lease=lease or None)
                log.info("datanode %s is STOPPING: %s", self.node_id, why)
        except MetaError as exc:  # etcd unreachable: the session expires after its TTL
            log.error("datanode %s could not say STOPPING: %s", self.node_id, exc)
        in_flight = self.in_flight
        abandoned = False
        if in_flight is not None:
            abandoned = bool(wait([in_flight], timeout=LEAVE_GRACE_SECONDS).not_done)
        self.syncer.shutdown(wait=False, cancel_futures=True)
        try:
            if gone:
                return f"node {self.node_id} left ({why}); its session was gone already"
            try:
                if lease:
                    store.revoke(lease)
                else:  # a session without a lease (never written by a node sensor)
                    store.delete(key)
            except MetaError as exc:
                log.error("datanode %s could not revoke its session: %s", self.node_id, exc)
        finally:
            # The run worker exits next: neither the abandoned sync nor PySpark's exit hook
            # may wait on a Spark Connect server that is slow to answer.
            drop_connect_session(self.runtime.spark)
        sync = "its sync in flight abandoned (fenced by the channel lease), " if abandoned else ""
        return (
            f"node {self.node_id} left ({why}): STOPPING, {sync}session revoked "
            f"{time.monotonic() - started:.2f}s after"
        )


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


class AtTeardown(dg.ConfigurableResource):
    """Callbacks Dagster calls when it tears the run's resources down, however the run ends:
    also when it was interrupted while Dagster (not the op) was running, where the op's
    generator sees nothing until it is closed, after the run. Resource `teardown` of the
    definitions; a resource of its own, as one with a teardown cannot be given to
    `build_sensor_context` outside a `with` (as the sensors' `vchan_env` is)."""

    _callbacks: list[Callable[[], None]] = PrivateAttr(default_factory=list)

    def call(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        while self._callbacks:
            callback = self._callbacks.pop()
            try:
                callback()
            except Exception:
                log.exception("a teardown callback of the sync loop failed")


@dg.op(name="node_sync_loop", out={}, tags={"kind": "spark"})
def node_sync_loop(
    context: dg.OpExecutionContext,
    config: LoopConfig,
    vchan: VchanResource,
    pyspark: PySparkResource,
    teardown: AtTeardown,
) -> Iterator[ReportedEvent]:
    """Sync the node's channels as their sync policies fire, reporting each sync as
    materializations of binlogs, segments and channel_checkpoints, until the loop's time
    is up or the node's session is gone (or STOPPING). Interrupted, the node leaves
    (`NodeSyncLoop.leave`)."""
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
        context.log.info(f"{LOOP_RUNNING}: node {config.node_id} (its etcd and Spark sessions are up)")

        def leave(why: str) -> None:
            if done := loop.leave(why):
                log.warning("%s", done)
                with contextlib.suppress(Exception):  # the generator closed after the run ended
                    context.log.warning(done)

        teardown.call(lambda: leave("its run was interrupted while Dagster stored an event"))
        try:
            while True:  # one look at the channels at least, then until the time is up
                faulthandler.dump_traceback_later(STUCK_SECONDS, repeat=True, file=2)
                started = time.monotonic()
                if not loop.alive():
                    context.log.info("node %s has no session any more: its sync loop ends", config.node_id)
                    break
                looked = time.monotonic()
                synced = loop.step()
                if (took := time.monotonic() - started) > SLOW_STEP_SECONDS:
                    context.log.warning(
                        f"node {config.node_id}: a look at its channels took {took:.1f}s (session "
                        f"{looked - started:.1f}s, channels and {synced} syncs {time.monotonic() - looked:.1f}s)"
                    )
                yield from loop.ready()
                for skipped in loop.skipped:
                    context.log.info("sync committed nothing: %s", skipped)
                loop.skipped.clear()
                if time.monotonic() >= ends:
                    break
                if not synced:
                    time.sleep(config.poll_seconds)
        except INTERRUPTS as exc:  # SIGTERM/SIGINT of the run worker: the node leaves
            leave(f"its run was interrupted ({type(exc).__name__})")
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()
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
