"""The DataNode process role (Milvus' DataNode server; Milvus' MEP 7, watch and release
channels via etcd; the lease design of Milvus' "DataNode removes its dependency on
DataCoord").

Lifecycle (Milvus' stateCode): a unique, never-reused node id from the ID allocator; a
session under `session/datanode/{id}` on an etcd lease kept alive by `Session`, whose
state is INITIALIZING until the node can work (watching its channels; with the Spark
engine, its Spark session started in the background at launch, so no sync pays the JVM
start), then HEALTHY (ABNORMAL if the Spark session failed: no channel is assigned to
it). Only a HEALTHY node gets channels. A Spark node probes its session every
VCHAN_HEALTH_INTERVAL: when its JVM no longer answers (killed, crashed, hung), the node
goes ABNORMAL with the reason in its session (the coordinator moves its channels; a ToWatch
that still arrives fails), starts a new Spark session and goes HEALTHY again. `stop()` is the graceful stop (SIGTERM): the
session says STOPPING first, so the coordinator moves the channels at once under new
leases; the node lets each sync in flight finish (or be refused by the new lease), then
revokes its session. Losing the session stops every channel at once (no zombie writer)
and the process exits. The node follows `channelwatch/{id}/` with a `PrefixWatcher`, which lists the
whole prefix at start and after a compaction (invariant 5).

Per-event logic lives in plain functions so a Dagster sensor or run can call it too:
  parse_watch_info(key, value)                       -> ChannelWatchInfo (MalformedValueError)
  watch_channel(ctx, key, version, info, start=...)  -> ChannelWatchInfo written (WatchSuccess/Failure)
  release_channel(ctx, key, version, info, stop=...) -> ChannelWatchInfo written (ReleaseSuccess)
  sync_once(ctx, collection, vchannel, lease)        -> SyncResult | None   (datanode.channel)
`DataNode` wires them to a watcher thread, one event lane per channel (`ChannelLanes`: a
slow release or re-watch of one channel never delays another's events) and one
`ChannelWorker` thread per channel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import replace
from functools import partial
from typing import Any

from vchan_assets import __version__
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import (
    CollectionNotFoundError,
    CollectionRegistry,
    VchannelNotFoundError,
)
from vchan_assets.datacoord.recovery import compare_recovery, recovery_info
from vchan_assets.datanode.channel import ChannelWorker, NodeContext, sync_once
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.channelwatch import END_STATES, parse_watch_info, vchannel_of
from vchan_assets.meta.errors import CasConflictError, MalformedValueError, MetaError, MetaUnavailableError
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore, Snapshot
from vchan_assets.meta.watch import EventKind, PrefixWatcher, WatchEvent
from vchan_assets.model import (
    ChannelLease,
    ChannelWatchInfo,
    CollectionInfo,
    NodeSession,
    RecoveryInfo,
    SessionState,
    VchannelInfo,
    WatchState,
)
from vchan_assets.spark import Engine
from vchan_assets.system import System

log = logging.getLogger(__name__)

__all__ = [
    "ChannelLanes",
    "DataNode",
    "NodeContext",
    "Tickler",
    "WatchFailedError",
    "is_end_state",
    "is_tickler_update",
    "parse_watch_info",
    "release_channel",
    "sync_once",
    "watch_channel",
]

# Seconds a health probe waits for the Spark session's JVM to answer.
PROBE_TIMEOUT = 10.0

StartChannel = Callable[[CollectionInfo, ChannelLease | None, VchannelInfo], None]
StopChannel = Callable[[str], None]


class WatchFailedError(MetaError):
    """A ToWatch could not be carried out; the reason goes into the WatchFailure info."""


def is_end_state(state: WatchState) -> bool:
    """States the coordinator waits for; a node ignores them (Milvus' isEndWatchState)."""
    return state in END_STATES


def is_tickler_update(info: ChannelWatchInfo) -> bool:
    """A ToWatch with progress > 0 is a node's own tickler write, not a new request
    (Milvus' DataNode: "DataNode received a PUT event with tickler update, ignore it").
    Re-handling it would restart the watch, whose final CAS then fails against the
    tickler's newer version."""
    return info.state is WatchState.TO_WATCH and info.progress != 0


class Tickler:
    """Keeps a long watch alive: every `interval` it compare-and-swaps the watch info with
    a higher `progress` and a pushed-back `timeout_ts`, so the coordinator's watch timeout
    is not hit (Milvus' tickler). `version` is the version to CAS the final state against."""

    def __init__(self, store: MetaStore, key: str, version: int, info: ChannelWatchInfo, settings: Settings):
        self.store = store
        self.key = key
        self.version = version
        self.info = info
        self.settings = settings
        self.lost = False  # somebody else changed the key: the watch is stale
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tickler {key}", daemon=True)

    def __enter__(self) -> Tickler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def tick(self, progress: int) -> None:
        with self._lock:
            if self.lost:
                return
            info = replace(
                self.info,
                progress=max(self.info.progress, min(progress, 99)),
                timeout_ts=time.time() + self.settings.watch_timeout,
            )
            try:
                self.store.cas(self.key, self.version, info)
            except CasConflictError:
                self.lost = True
                return
            except MetaError as exc:
                log.warning("tickler of %s: %s", self.key, exc)
                return
            self.info = info
            self.version += 1

    def _run(self) -> None:
        progress = 0
        while not self._stop.wait(self.settings.tickler_interval):
            progress += 10
            self.tick(progress)


def watch_channel(
    ctx: NodeContext,
    key: str,
    version: int,
    info: ChannelWatchInfo,
    start: StartChannel | None = None,
) -> ChannelWatchInfo:
    """Carry out a ToWatch: check the lease in the watch info is the channel's current
    lease, read the channel's recovery info and check it against the coordinator's
    VchannelInfo (`_check_assignment`), `start(collection, lease, vchan)` the channel's work, then
    compare-version-and-swap the info to WatchSuccess (WatchFailure with the reason if any
    step failed). Returns what was written. Raises CasConflictError if the key changed
    since `version` (the coordinator moved on; the caller must undo `start`)."""
    vchannel = info.vchan.channel_name
    with Tickler(ctx.system.store, key, version, info, ctx.system.settings) as tickler:
        try:
            lease = _take_lease(ctx, info)
            collection = CollectionRegistry(ctx.system.store).get(info.vchan.collection_id)
            recovery = recovery_info(ctx.system.store, collection, vchannel)
            _check_assignment(ctx, info.vchan, recovery)
            vchan = replace(
                info.vchan,
                seek_position=recovery.seek_position,
                unflushed_segment_ids=recovery.unflushed_segment_ids,
                flushed_segment_ids=recovery.flushed_segment_ids,
                dropped_segment_ids=recovery.dropped_segment_ids,
            )
            if start is not None:
                start(collection, lease, vchan)
            result = replace(tickler.info, vchan=vchan, state=WatchState.WATCH_SUCCESS, progress=100)
        except (WatchFailedError, CollectionNotFoundError, VchannelNotFoundError, MalformedValueError) as exc:
            log.error("node %s: watch of %s failed: %s", ctx.node_id, vchannel, exc)
            result = replace(tickler.info, state=WatchState.WATCH_FAILURE, reason=str(exc))
        with tickler._lock:
            tickler.lost = True  # no more ticks: the final state is written now
            ctx.system.store.cas(key, tickler.version, result)
    log.info("node %s: %s -> %s (lease %s)", ctx.node_id, vchannel, result.state.value, info.lease_id)
    return result


def _check_assignment(ctx: NodeContext, assigned: VchannelInfo, found: RecoveryInfo) -> None:
    """The coordinator's VchannelInfo was read before it granted the lease; the node's own
    reading, made once the lease is its own (nobody else can commit after that), is the one
    the channel starts from. Meta only moves forward, so the node's reading may be newer (a
    commit landed in between: logged) but never older: an older one means meta went back
    in time (etcd restored from a backup), and the watch fails so that the coordinator
    assigns the channel again from a fresh read rather than two views of it being in use."""
    diff = compare_recovery(assigned, found)
    vchannel = assigned.channel_name
    if diff.regressed:
        raise WatchFailedError(
            f"channel {vchannel}: meta is behind the coordinator's assignment "
            f"({'; '.join(diff.regressed)}); was etcd restored from an older backup? "
            "The coordinator assigns the channel again from what etcd holds now"
        )
    if diff.advanced:
        log.info(
            "node %s: %s moved on since the coordinator's assignment (%s): starting from the newer meta",
            ctx.node_id,
            vchannel,
            "; ".join(diff.advanced),
        )


def _take_lease(ctx: NodeContext, info: ChannelWatchInfo) -> ChannelLease | None:
    vchannel = info.vchan.channel_name
    if info.lease_id is None:
        return None  # older coordinator: commits go through DataCoord's watcher check
    current = ctx.system.store.read_lease(vchannel)
    if current is None or current.lease_id != info.lease_id:
        found = None if current is None else current.lease_id
        raise WatchFailedError(f"channel {vchannel}: lease {info.lease_id} is not current (found {found})")
    return current


def release_channel(
    ctx: NodeContext,
    key: str,
    version: int,
    info: ChannelWatchInfo,
    stop: StopChannel | None = None,
) -> ChannelWatchInfo:
    """Carry out a ToRelease: `stop(vchannel)` the channel's work, then CAS ReleaseSuccess
    (Milvus' DataNode: "there is no reason why we release fail")."""
    vchannel = info.vchan.channel_name
    if stop is not None:
        stop(vchannel)
    result = replace(info, state=WatchState.RELEASE_SUCCESS, progress=100)
    ctx.system.store.cas(key, version, result)
    log.info("node %s: released %s", ctx.node_id, vchannel)
    return result


class ChannelLanes:
    """One event lane per vchannel (Milvus: one channel event manager per vchannel): a
    channel's events are handled in order on a thread of its own, so a slow release (its
    final sync) or a re-watch waiting for the old worker never delays another channel's
    ToWatch or ToRelease. A lane's thread ends when its queue is empty."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queues: dict[str, deque[tuple[Hashable, Callable[[], None]]]] = {}
        self._closed = False

    def submit(self, vchannel: str, job: Callable[[], None], token: Hashable = None) -> None:
        """Queue `job` on `vchannel`'s lane (dropped if a job with the same non-None `token`
        is still queued there: a resync repeating a change not handled yet)."""
        with self._lock:
            if self._closed:
                return
            queue = self._queues.get(vchannel)
            if queue is not None:
                if token is None or all(t != token for t, _ in queue):
                    queue.append((token, job))
                return
            self._queues[vchannel] = deque([(token, job)])
        lane = threading.Thread(
            target=self._drain, args=(vchannel,), name=f"{self.name} {vchannel}", daemon=True
        )
        lane.start()

    def busy(self, vchannel: str) -> bool:
        with self._lock:
            return vchannel in self._queues

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every lane has run its queue; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queues, timeout)

    def close(self) -> None:
        """Accept no more jobs (the node is stopping); queued ones still run."""
        with self._lock:
            self._closed = True

    def _drain(self, vchannel: str) -> None:
        while True:
            with self._lock:
                queue = self._queues[vchannel]
                if not queue:
                    del self._queues[vchannel]
                    self._idle.notify_all()
                    return
                _, job = queue.popleft()
            try:
                job()
            except Exception:
                log.exception("%s: event of %s failed", self.name, vchannel)


class DataNode:
    """A DataNode: session, watch of its channelwatch prefix, one event lane and one worker
    per channel."""

    def __init__(
        self,
        system: System,
        engine: Engine = "local",
        poll_interval: float = 1.0,
        address: str = "",
        on_session_lost: Callable[[], None] | None = None,
        resync_interval: float = 5.0,
    ) -> None:
        self.system = system
        self.store, self.settings = system.store, system.settings
        self.engine = engine
        self.poll_interval = poll_interval
        self.address = address
        self.on_session_lost = on_session_lost
        self.resync_interval = resync_interval
        self.node_id = 0
        self.session: Session | None = None
        self.watcher: PrefixWatcher | None = None
        self.workers: dict[str, ChannelWorker] = {}
        self._retired: list[ChannelWorker] = []  # stopped on session loss, maybe mid-sync
        self.lease_losses = 0
        self.session_lost = threading.Event()
        self.stopped = threading.Event()
        self._lock = threading.RLock()
        # Each channel's events run in order on its own lane; a key's change is handled
        # once, whichever path (watch event, relist, resync) brings it first. A key belongs
        # to one channel, so only its own lane reads or writes its entry.
        self.lanes = ChannelLanes("datanode events")
        self._handled: dict[str, int] = {}  # key -> mod_revision handled
        self._resync: threading.Thread | None = None
        self.record: NodeSession | None = None  # the session's value, in its current state
        self.ready = threading.Event()  # set once the node left INITIALIZING
        self.recoveries = 0  # restarts of the engine after a failed health probe

    @property
    def ctx(self) -> NodeContext:
        return NodeContext(self.system, self.node_id, self.engine, self.poll_interval)

    @property
    def channels(self) -> list[str]:
        with self._lock:
            return sorted(v for v, w in self.workers.items() if w.running)

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> DataNode:
        """Register (INITIALIZING), start watching, then go HEALTHY."""
        # Never reused: the allocator's mark only grows, so no stale channelwatch key of an
        # earlier node can belong to this one (Milvus' MEP 7).
        self.node_id = IdAllocator(self.store, batch=1).alloc()
        record = NodeSession(self.node_id, self.address, __version__, time.time(), SessionState.INITIALIZING)
        self.session = Session.for_datanode(
            self.store, record, self.settings.session_ttl, on_expired=self._lost_session
        ).register()
        self.record = record
        self.watcher = PrefixWatcher(
            self.store,
            self.store.keys.channel_watch.under(self.node_id),
            on_event=self._on_event,
            on_relist=self._on_relist,
        ).start()
        self._resync = threading.Thread(target=self._resync_loop, name="channelwatch resync", daemon=True)
        self._resync.start()
        if self.engine == "spark":
            threading.Thread(target=self._watch_engine, name="spark health", daemon=True).start()
        else:
            self._enter(SessionState.HEALTHY)
        return self

    @property
    def state(self) -> SessionState:
        return SessionState.INITIALIZING if self.record is None else self.record.state

    def _enter(self, state: SessionState, reason: str = "") -> bool:
        """Write `state` (for `reason`) into the session (unless the node is already STOPPING)."""
        with self._lock:
            if self.session is None or self.record is None:
                return False
            if self.record.state is SessionState.STOPPING and state is not SessionState.STOPPING:
                return False
            record = self.record.entered(state, reason=reason)
            try:
                self.session.update(record)
            except MetaError as exc:
                log.error("datanode %s could not enter %s: %s", self.node_id, state.value, exc)
                return False
            self.record = record
        if state is not SessionState.INITIALIZING:
            self.ready.set()
        because = f": {reason}" if reason else ""
        log.info("datanode %s is %s (engine %s)%s", self.node_id, state.value, self.engine, because)
        return True

    def _watch_engine(self) -> None:
        """The Spark engine's health: start the session at launch (the JVM start took 12 s of
        the first sync), then probe it every VCHAN_HEALTH_INTERVAL (`probe_spark`: its JVM
        answers). HEALTHY while it does; a failed start or probe makes the node ABNORMAL with
        the reason (the coordinator moves its channels, new ones are refused) and the
        session is started again (`reset_spark`: a new JVM) at each interval until it
        works: HEALTHY again."""
        from vchan_assets.spark.session import SparkUnavailableError, probe_spark, reset_spark

        spark = self._start_spark(first=True)
        while not self.stopped.wait(self.settings.health_interval) and not self.session_lost.is_set():
            if spark is not None:
                try:
                    probe_spark(spark, PROBE_TIMEOUT)
                    continue
                except SparkUnavailableError as exc:
                    log.error("datanode %s: health probe failed: %s", self.node_id, exc)
                    self._enter(SessionState.ABNORMAL, str(exc))
            self.recoveries += 1
            reset_spark()
            spark = self._start_spark(first=False)

    def _start_spark(self, first: bool) -> Any:
        """Start the Spark session and run a first job (the executors answer, not only the
        driver); HEALTHY if it did, else ABNORMAL with the reason. The session, or None."""
        from vchan_assets.spark.session import get_spark

        started = time.monotonic()
        try:
            spark = get_spark(self.settings)
            spark.range(1).count()
        except Exception as exc:
            log.exception("datanode %s: the Spark session did not start", self.node_id)
            what = "did not start" if first else "did not start again"
            self._enter(SessionState.ABNORMAL, f"Spark session {what}: {type(exc).__name__}: {exc}"[:500])
            return None
        log.info("datanode %s: Spark session up in %.1fs", self.node_id, time.monotonic() - started)
        self._enter(SessionState.HEALTHY)
        return spark

    def stop(self, final_sync: bool = True) -> None:
        """Graceful stop: the session says STOPPING (the coordinator moves the channels at
        once, under new leases); stop watching; stop every channel (with `final_sync`, after
        a last sync of what the log holds, which the new owner's lease refuses if it was
        already granted; without, the sync in flight finishes or is refused); then revoke
        the session. Each channel gets VCHAN_STOP_TIMEOUT to stop."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.lanes.close()  # the coordinator's deletes of the watch infos need no handling
        if not self.session_lost.is_set():
            self._enter(SessionState.STOPPING)
        if self.watcher is not None:
            self.watcher.stop()
        if self._resync is not None:
            self._resync.join(self.store.client.timeout + 1)
        with self._lock:
            workers, self.workers = list(self.workers.values()), {}
        for w in workers:
            w.stop(
                final_sync=final_sync and not self.session_lost.is_set(),
                timeout=self.settings.stop_timeout,
                reason="node stop",
            )
        for w in self._retired:
            # A sync in flight when the session was lost ends here: its commit is rejected by
            # the lease (a new owner holds it) and nothing partial is written.
            w.stop(timeout=60)
        if self.session is not None:
            self.session.close()
        log.info("datanode %s stopped", self.node_id)

    def _lost_session(self) -> None:
        """Liveness lost: every channel stops now, without a final sync (no zombie writer)."""
        self.session_lost.set()
        self.lanes.close()
        log.error("datanode %s lost its session: stopping all channel work", self.node_id)
        if self.watcher is not None:
            self.watcher.stop(timeout=0)
        with self._lock:
            workers, self.workers = list(self.workers.values()), {}
        for w in workers:
            w.stop(final_sync=False, timeout=0, reason="session lost")
        self._retired.extend(workers)
        if self.on_session_lost is not None:
            self.on_session_lost()

    # --- watch events --------------------------------------------------------------

    def _on_relist(self, snapshot: Snapshot) -> None:
        """The whole prefix (at start, after a compaction, and every `resync_interval` as a
        retry of changes whose handling failed): watch/release what it says, and release
        channels it no longer lists. Each channel's part runs on its lane."""
        present = set()
        for kv in snapshot.items:
            vchannel = vchannel_of(kv.key)
            present.add(vchannel)
            job = partial(self._handle_put, kv.key, kv.version, kv.value, kv.mod_revision)
            self.lanes.submit(vchannel, job, token=(kv.key, kv.mod_revision))
        with self._lock:
            gone = [v for v in self.workers if v not in present]
        for vchannel in gone:
            job = partial(self._release_unlisted, vchannel, snapshot.revision)
            self.lanes.submit(vchannel, job, token=("unlisted", vchannel))

    def _on_event(self, event: WatchEvent) -> None:
        vchannel = vchannel_of(event.key)
        if event.kind is EventKind.DELETE:
            self.lanes.submit(vchannel, partial(self._handle_delete, event.key, event.mod_revision))
            return
        job = partial(self._handle_put, event.key, event.version, event.value, event.mod_revision)
        self.lanes.submit(vchannel, job, token=(event.key, event.mod_revision))

    def _handle_delete(self, key: str, mod_revision: int) -> None:
        if mod_revision <= self._handled.get(key, 0):
            return  # a relist already handled this change or a later one
        self._handled[key] = mod_revision
        log.info("node %s: %s deleted: releasing", self.node_id, key)
        self._stop_channel(vchannel_of(key))

    def _release_unlisted(self, vchannel: str, revision: int) -> None:
        if self._handled.get(self.store.keys.channel_watch(self.node_id, vchannel), 0) > revision:
            # Its watch info was handled at a later revision than the snapshot's (an event
            # overtook this relist): the snapshot is stale, the channel is not gone.
            return
        log.info("node %s: %s is no longer assigned (relist): releasing", self.node_id, vchannel)
        self._stop_channel(vchannel)

    def _resync_loop(self) -> None:
        prefix = self.store.keys.channel_watch.under(self.node_id)
        while not self.stopped.wait(self.resync_interval) and not self.session_lost.is_set():
            try:
                snapshot = self.store.list_prefix(prefix)
            except MetaError as exc:
                log.warning("node %s: resync of %s failed: %s", self.node_id, prefix, exc)
                continue
            try:
                self._on_relist(snapshot)
            except Exception:
                log.exception("node %s: resync of %s failed", self.node_id, prefix)

    def _handle_put(self, key: str, version: int, value: bytes, mod_revision: int) -> None:
        if self.session_lost.is_set() or self.stopped.is_set():
            return
        if mod_revision <= self._handled.get(key, 0):
            return
        try:
            info = parse_watch_info(key, value)
        except MalformedValueError as exc:
            self._handled[key] = mod_revision  # logged once
            log.error("node %s: skipping malformed watch info: %s", self.node_id, exc)
            return
        if is_end_state(info.state) or is_tickler_update(info):
            self._handled[key] = mod_revision
            return
        try:
            if info.state is WatchState.TO_WATCH:
                watch_channel(self.ctx, key, version, info, start=self._start_channel)
            elif info.state is WatchState.TO_RELEASE:
                release_channel(self.ctx, key, version, info, stop=self._stop_channel)
            self._handled[key] = mod_revision
        except MetaUnavailableError as exc:
            # Not marked handled: the resync retries it once etcd answers again.
            log.warning("node %s: handling %s failed, will retry: %s", self.node_id, key, exc)
            if info.state is WatchState.TO_WATCH:
                self._stop_channel(info.vchan.channel_name, final_sync=False)
        except CasConflictError as exc:
            self._handled[key] = mod_revision
            # The coordinator changed the key meanwhile (reassigned or deleted it): the
            # work started for it must not run on (Milvus: "release flowgraph").
            log.warning("node %s: %s changed under us (%s): releasing", self.node_id, key, exc)
            self._stop_channel(info.vchan.channel_name)

    def _start_channel(
        self, collection: CollectionInfo, lease: ChannelLease | None, vchan: VchannelInfo
    ) -> None:
        vchannel = vchan.channel_name
        with self._lock:
            old = self.workers.pop(vchannel, None)
        if old is not None:
            old.stop(timeout=60, reason="re-watched")
        worker = ChannelWorker(self.ctx, collection, vchannel, lease, on_stopped=self._worker_stopped)
        with self._lock:
            if self.session_lost.is_set() or self.stopped.is_set():
                raise WatchFailedError(f"node {self.node_id} is stopping")
            if self.state is SessionState.ABNORMAL:  # a ToWatch written before the coordinator saw it
                reason = self.record.reason if self.record else ""
                raise WatchFailedError(f"node {self.node_id} is ABNORMAL: {reason}")
            self.workers[vchannel] = worker.start()
        log.info("node %s: watching %s from %s", self.node_id, vchannel, vchan.seek_position)

    def _stop_channel(self, vchannel: str, final_sync: bool = True) -> None:
        with self._lock:
            worker = self.workers.pop(vchannel, None)
        if worker is not None:
            worker.stop(final_sync=final_sync, timeout=120, reason="released")

    def _worker_stopped(self, vchannel: str, reason: str) -> None:
        self.lease_losses += 1
        with self._lock:
            w = self.workers.get(vchannel)
            if w is not None and w.stop_reason == reason:
                del self.workers[vchannel]
