"""The DataCoord process role: active-standby through an etcd election (as Milvus'
DataCoord server), running the channel manager, the segment manager's seal policies and
the periodic meta reload of the lease design of Milvus' "DataNode removes its dependency
on DataCoord".

Everything the active coordinator decides is in etcd, so a standby that wins the
election continues where the dead one stopped (a pending move: the ToRelease/ReleaseSuccess
it finds is finished by `ChannelManager.reconcile`).

Every write of the active coordinator is fenced by its election term (`MetaStore.fenced`):
a coordinator deposed in the middle of a tick (paused past its TTL, partitioned) cannot
grant a lease or move a channel after a newer leader was elected.

The active coordinator watches the DataNode sessions (etcd watch): a node that appears,
changes state (STOPPING: a graceful stop) or disappears wakes the loop at once, so its
channels move without waiting for the next tick; so does a node's answer in
`channelwatch/` (ReleaseSuccess lets a balance move go on to its ToWatch at once); the tick every `interval` stays as the
safety net and for the seal policies. `stop()` (SIGTERM) is Milvus' DataCoord Stop: the
election key says STOPPING first, then the coordinator resigns, and a standby (which
watches that key) takes over at once; the `on_stopping` steps run just before it resigns
(`vchan datacoord`: the task batches in flight are abandoned, so the process exits at once
rather than after a build of minutes whose commit its ended term would refuse anyway).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vchan_assets import __version__
from vchan_assets.config import Settings
from vchan_assets.datacoord import segment_summary
from vchan_assets.datacoord.channel_manager import ChannelManager, ReconcileReport
from vchan_assets.datacoord.segment_manager import FlushRecovery, SealedSegment, SegmentManager
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.channelwatch import END_STATES
from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MalformedValueError, MetaError, NotLeaderError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.session import Election
from vchan_assets.meta.store import Fence, MetaStore, SegmentCopy, Snapshot
from vchan_assets.meta.watch import EventKind, PrefixWatcher, WatchEvent
from vchan_assets.model import ChannelWatchInfo, NodeSession, SessionState

log = logging.getLogger(__name__)


@dataclass
class MetaReloader:
    """The lease design's "DataCoord reloads from metastore periodically": segment meta, only if it
    changed since it was seen last (the open segments live in the channel heads in etcd;
    what is reloaded here are Growing segments on no head, which get sealed). A change is
    a higher mod revision or a different count of segment keys, live or dropped: a deletion
    moves no remaining key's revision. (Channel checkpoints are read where they are used: by the
    recovery info of an assignment.) Each reload also repairs the per-vchannel segment
    index (`SegmentMeta.repair_channel_index`, keys only): during a rolling upgrade a
    process of a version before the index creates segments without their entries. With a
    segment cache the listing comes from memory and the repair reads the entries of the
    segments created or deleted since the last reload only. Each reload counts the segments
    it listed into the per-collection segment summaries `vchan status` reads, put where they
    changed (datacoord/segment_summary.py)."""

    store: MetaStore
    segments: SegmentManager
    # (highest mod revision, count) of the live segment keys, then of the dropped family's
    seen: tuple[int, ...] = ()
    reloads: int = 0  # metric
    # With a segment cache (`vchan datacoord`): the index entry of each segment key at the
    # last reload, so the next repairs only what was created or deleted since (a full
    # repair at the first reload of a term and every FULL_REPAIR_EVERY reloads).
    entries: dict[str, str] | None = None

    def reload(self) -> bool:
        """Returns whether segment meta was reloaded (also when only a collection lacked
        its segment summary)."""
        door = SegmentMeta(self.store)
        listing = door.segment_keys()  # read once: for the change, then for the repair
        seen = (*door.changes_seen(listing), *door.dropped_changes_seen())  # (GC deletes there)
        if seen == self.seen and not segment_summary.missing(self.store):
            return False
        if self.store.segment_cache is None:
            door.repair_channel_index(listing)
        else:
            self._repair_from_cache(door, listing)
        # from the cache where it is, and the dropped family (the summaries count the
        # Dropped segments GC keeps and time flush -> sorted from the sorts' dropped inputs)
        found = [d.model for d in door.list(skip_malformed=True, include_dropped=True)]
        self.segments.seal_orphans(found)  # (Growing ones only)
        segment_summary.write_summaries(self.store, found, listing.revision)
        self.seen = seen
        self.reloads += 1
        self._freeze_loaded()
        return True

    def _freeze_loaded(self) -> None:
        """After the first reload of each segment cache load, which decoded every record:
        garbage collected, then every object left moved out of the collector's sight
        (`gc.freeze`). A full collection walks every tracked object, and the decoded meta
        of 100,000 segments is millions of them: 2 s a pass on the machine of BENCHMARKS.md,
        a DataCoord step stalled whenever allocations tripped one. The records hold no
        reference cycles, so reference counting still frees each when a later version or
        a relist replaces it; the frozen generation only shrinks from there."""
        cache = self.store.segment_cache
        if cache is None or _frozen_loads.get(cache) == cache.loads:
            return
        started = time.monotonic()
        gc.collect()
        gc.freeze()
        _frozen_loads[cache] = cache.loads
        log.info(
            "segment meta frozen out of garbage collection: %d objects (%.2fs)",
            gc.get_freeze_count(),
            time.monotonic() - started,
        )

    def _repair_from_cache(self, door: SegmentMeta, listing: Snapshot) -> None:
        if self.entries is None or self.reloads % FULL_REPAIR_EVERY == 0:
            door.repair_channel_index(listing)
            self.entries = door.index_entries(listing.items)
            return
        keys = {kv.key for kv in listing.items}
        created = keys - self.entries.keys()
        deleted = self.entries.keys() - keys
        door.repair_channel_index_of(listing, self.entries, created, deleted)
        for key in deleted:
            del self.entries[key]
        self.entries.update(door.index_entries([kv for kv in listing.items if kv.key in created]))


# Each segment cache's load whose records were frozen, by any reloader of the process (the
# Dagster host makes a coordinator per sensor tick, over the one cache its process shares).
_frozen_loads: weakref.WeakKeyDictionary[SegmentCopy, int] = weakref.WeakKeyDictionary()

# Reloads between two full repairs of the per-vchannel index where the reload repairs only
# what changed (a segment created and deleted between two reloads by a process of a version
# before the index leaves an entry only a full repair finds).
FULL_REPAIR_EVERY = 120

# Defaults of `vchan datacoord --interval/--reload-interval`, and of the Dagster-hosted
# coordinator (which ticks at its sensor's pace and reloads this often).
TICK_INTERVAL = 0.5  # seconds between reconcile steps
RELOAD_INTERVAL = 5.0  # seconds between reloads of segment meta


@dataclass(frozen=True)
class CoordinatorTick:
    channels: ReconcileReport
    sealed: tuple[SealedSegment, ...] = ()
    reloaded: bool = False
    recovered: tuple[FlushRecovery, ...] = ()  # on the first tick of a term


class DataCoordinator:
    """One DataCoord contender. The active one (election winner) runs `tick` in a loop;
    every write of a term goes through `writer`, the store fenced by that term's election
    key, so a deposed leader still mid-tick writes nothing (NotLeaderError).

    Two hosts run the same steps: `run(stop)` (the `vchan datacoord` process, leadership
    kept by the election's keep-alive thread) and a Dagster sensor (`begin_term` with the
    fence of a term held by its ticks, then `tick` per sensor tick)."""

    def __init__(
        self,
        settings: Settings,
        store: MetaStore,
        interval: float = TICK_INTERVAL,
        reload_interval: float = RELOAD_INTERVAL,
        address: str = "",
        server_id: int | None = None,
        on_stopping: Sequence[Callable[[MetaStore], object]] = (),
    ) -> None:
        self.settings = settings
        self.on_stopping = list(on_stopping)  # run by `stop()` with the term's store, before it resigns
        self.store = store
        self.interval = interval
        self.reload_interval = reload_interval
        self.ids = IdAllocator(store, batch=100)
        self.address = address
        self.server_id = server_id or self.ids.alloc()
        self.election = Election(
            store,
            self.session_record(address),
            settings.session_ttl,
            on_lost=self._lost,
        )
        self.writer: MetaStore | None = None  # the store fenced by the current term
        self.channels: ChannelManager | None = None
        self.segments: SegmentManager | None = None
        self.reloader: MetaReloader | None = None
        self.recovered: list[FlushRecovery] = []
        self.channel_index_ready = False  # the per-vchannel segment index is complete
        self.active = threading.Event()
        self.stopping = threading.Event()
        self._stop_once = threading.Lock()  # held once `stop()` began
        self.wake = threading.Event()  # a DataNode session changed: reconcile now
        self.wakes = 0  # metric: session changes that woke the loop
        self.last_reload = 0.0  # wall clock: a sensor host carries it from tick to tick

    def session_record(self, address: str) -> NodeSession:
        """What the election key holds while this contender leads."""
        now = time.time()
        return NodeSession(self.server_id, address, __version__, now, SessionState.HEALTHY, now)

    # --- step functions (also for a sensor) ------------------------------------------------

    def begin_term(self, fence: Fence) -> None:
        """Every write from now on is fenced by `fence` (this contender's term)."""
        self.writer = self.store.fenced(fence)
        self.channels = ChannelManager(self.writer, self.settings, self.ids)
        self.segments = SegmentManager(self.writer, self.settings, self.ids)
        self.reloader = MetaReloader(self.writer, self.segments)

    def activate(self, fence: Fence | None = None) -> list[FlushRecovery]:
        """What the new active coordinator does first: load segment meta, complete
        Flushing segments whose checkpoint passed (recover_flushing). `fence`: the term
        (default: the term this contender's election won; NotLeaderError if none)."""
        fence = fence or self.election.fence()
        if fence is None:
            held = self.election.leader()
            raise NotLeaderError(self.election.key, 0, held.create_revision if held else None)
        self.begin_term(fence)
        assert self.segments is not None and self.reloader is not None
        self.recovered = self.segments.recover_flushing()
        self.reloader.reload()
        self.last_reload = time.time()
        self.active.set()
        log.info(
            "datacoord %s is active (%d flushing segments recovered)", self.server_id, len(self.recovered)
        )
        return self.recovered

    def tick(self, now: float | None = None) -> CoordinatorTick:
        """One round: channel reconcile, seal policies, and the meta reload when due. The
        first tick of a term completes the per-vchannel segment index of a stack written
        before it (`SegmentMeta.backfill_channel_index`: one get once it is complete)."""
        if self.channels is None or self.segments is None or self.reloader is None:
            self.activate()
        assert self.channels is not None and self.segments is not None and self.reloader is not None
        if not self.channel_index_ready:
            assert self.writer is not None
            SegmentMeta(self.writer).backfill_channel_index()
            self.channel_index_ready = True
        now = time.time() if now is None else now
        report = self.channels.reconcile(now)
        sealed = tuple(self.segments.seal_by_policy(now))
        reloaded = False
        if time.time() - self.last_reload >= self.reload_interval:
            reloaded = self.reloader.reload()
            self.last_reload = time.time()
        return CoordinatorTick(report, sealed, reloaded)

    # --- long-running ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Campaign; while active, tick every `interval` and whenever a DataNode session
        changes; on leadership loss campaign again. On `stop`, `self.stop()`: STOPPING, then
        resign (a standby takes over at once)."""
        threading.Thread(target=self._stop_on, args=(stop,), name="datacoord stop", daemon=True).start()
        try:
            while not self.stopping.is_set():
                if not self.election.campaign(timeout=max(self.interval, 2.0)):
                    continue
                log.info("datacoord %s won the election", self.server_id)
                try:
                    self.activate()
                    sessions = self._watch(self.store.keys.datanode_session.prefix, self._session_changed)
                    answers = self._watch(self.store.keys.channel_watch.prefix, self._answer_written)
                    with sessions, answers:
                        self._lead()
                except MetaError as exc:
                    log.warning("datacoord activation failed (%s); campaigning again", exc)
                self.election.resign()
                self._stand_by()
        finally:
            self._stand_by()
            self.election.resign()
            log.info("datacoord %s stopped", self.server_id)

    def _lead(self) -> None:
        while not self.stopping.is_set() and self.election.is_leader:
            self.wake.clear()
            try:
                self.tick()
            except NotLeaderError as exc:
                log.error("datacoord %s was deposed mid-tick: %s", self.server_id, exc)
                return
            except MetaError as exc:
                log.warning("datacoord tick failed (%s); retrying", exc)
            self.wake.wait(self.interval)

    def _watch(self, prefix: str, on_event: Callable[[WatchEvent], None]) -> PrefixWatcher:
        """A watch whose events may wake the loop (a relist always does)."""
        return PrefixWatcher(self.store, prefix, on_event=on_event, on_relist=self._listed)

    def _answer_written(self, event: WatchEvent) -> None:
        """A node's answer (ReleaseSuccess, WatchFailure, ...) lets the next step of a move
        run now; the coordinator's own writes and the ticklers' do not wake it."""
        if event.kind is EventKind.DELETE or not event.value:
            return
        try:
            state = decode(event.key, event.value, ChannelWatchInfo).state
        except MalformedValueError:
            return  # the step logs and removes it
        if state in END_STATES:
            self.wakes += 1
            self.wake.set()

    def _session_changed(self, event: WatchEvent) -> None:
        self.wakes += 1
        self.wake.set()

    def _listed(self, snapshot: Snapshot) -> None:
        self.wake.set()

    def _stop_on(self, stop: threading.Event) -> None:
        stop.wait()
        self.stop()

    def stop(self) -> None:
        """Seed `Stop`: the election key says STOPPING first (while this one leads), the
        `on_stopping` steps run (the task scheduler puts its batches in flight back in the
        queue), then resign at once, so a standby takes over without waiting for the TTL.
        A write of a tick or task still in flight is refused by the fence (every step is a
        compare-and-swap, so the standby continues from what etcd holds)."""
        if not self._stop_once.acquire(blocking=False):
            return
        # `stopping` is set only after the steps below: the loop goes on leading (and the
        # term's store stays open) until they ran, then it resigns too.
        session = self.election.session
        if session is not None and session.alive:
            try:
                session.update(self.session_record(self.address).entered(SessionState.STOPPING))
            except MetaError as exc:
                log.warning("datacoord %s: could not say STOPPING (%s)", self.server_id, exc)
        writer = self.writer
        if writer is not None and self.election.is_leader:
            for hook in self.on_stopping:  # e.g. the task scheduler gives up its batches in flight
                try:
                    hook(writer)
                except MetaError as exc:
                    log.warning("datacoord %s: stopping step failed (%s)", self.server_id, exc)
        self.stopping.set()
        self.active.clear()
        self.election.resign()
        self.wake.set()
        log.info("datacoord %s is STOPPING: resigned", self.server_id)

    def _stand_by(self) -> None:
        self.active.clear()
        self.writer = self.channels = self.segments = self.reloader = None

    def _lost(self) -> None:
        self.active.clear()
        log.error("datacoord %s lost its leadership: standing by", self.server_id)
