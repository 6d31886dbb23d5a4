"""The hand-off after flush, pushed: a flushed segment is sorted as soon as it is flushed.

The flush writes a segment Flushed **and invisible** in one meta update
(`datacoord.segment_ops.complete_flush`, Milvus' postFlush); readers serve it as growing
until its sorted copy replaces it (`query.view`). `SortQueue` learns of each such segment
from an etcd watch on segment meta the moment the flush commits, and the DataCoord's
lifecycle loop (`run_lifecycle`) has it sorted at once. Nothing is lost between
the write and the push: the push *is* the write, seen through the watch, and a watcher that
(re)starts lists every segment first. A full scan every VCHAN_SORT_SCAN_INTERVAL (60 s) is
only a safety net, as Milvus keeps one.

The sorts run through the DataCoord's task scheduler (`datacoord.tasks.TaskScheduler`:
sorts and index builds): a push queues the sort tasks of its collections and the
scheduler runs them, the index builds the sorts' commits push after them; the scan queues
every kind's tasks (at the start of each term too: the queue a dead DataCoord left is
taken over), and the kinds that follow another (index builds) are scanned every
TASK_SCAN_INTERVAL (CreateIndex's builds).

The same loop runs the compaction check every VCHAN_COMPACTION_CHECK_INTERVAL (L0
compaction of partitions past a count or size of L0 segments, mix compaction of small
segments: compaction keeps up with ingest) and the whole lifecycle step (every trigger,
plan cleanup, GC) every VCHAN_LIFECYCLE_INTERVAL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from vchan_assets.config import Settings
from vchan_assets.datacoord.tasks import TaskScheduler
from vchan_assets.failpoints import failpoint
from vchan_assets.lifecycle.compaction import compactable
from vchan_assets.lifecycle.gc import GcPass
from vchan_assets.lifecycle.plans import PlanState
from vchan_assets.lifecycle.step import compaction_check, lifecycle_step
from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MalformedValueError, MetaError
from vchan_assets.meta.store import MetaStore, Snapshot
from vchan_assets.meta.watch import EventKind, PrefixWatcher, WatchEvent
from vchan_assets.model import SegmentInfo
from vchan_assets.spark import Engine
from vchan_assets.storage import Storage, StorageError
from vchan_assets.system import System
from vchan_assets.wal.format import LogError

log = logging.getLogger(__name__)


def awaits_sort(seg: SegmentInfo) -> bool:
    """A Flushed L1/L2 segment with rows that is not sorted by pk: the stats task's work."""
    return compactable(seg) and not seg.is_sorted


class SortQueue:
    """Collections with segments waiting for their sort, fed by a watch on segment meta.

    `watch(store)` gives the watcher that feeds it (`on_relist` at its start, `on_event`
    for every change after); `take(timeout)` waits for work and hands it over."""

    def __init__(self) -> None:
        self._waiting: dict[int, set[int]] = {}  # collection id -> segment ids
        self._changed = threading.Condition()

    def offer(self, seg: SegmentInfo) -> None:
        if awaits_sort(seg):
            self.put(seg.collection_id, {seg.id})

    def put(self, collection_id: int, segment_ids: set[int]) -> None:
        with self._changed:
            self._waiting.setdefault(collection_id, set()).update(segment_ids)
            self._changed.notify_all()

    def on_event(self, event: WatchEvent) -> None:
        if event.kind is EventKind.PUT:
            self.offer(event.decode(SegmentInfo))  # a malformed value: logged and counted by the watcher

    def on_relist(self, snapshot: Snapshot) -> None:
        for kv in snapshot.items:
            try:
                self.offer(decode(kv.key, kv.value, SegmentInfo))
            except MalformedValueError as exc:
                log.warning("sort queue: skipping %s", exc)

    def take(self, timeout: float) -> dict[int, set[int]]:
        """The waiting segments by collection (emptied), after at most `timeout` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._waiting), timeout=max(0.0, timeout))
            waiting, self._waiting = self._waiting, {}
            return waiting

    def watch(self, store: MetaStore) -> PrefixWatcher:
        return PrefixWatcher(store, store.keys.segment.prefix, self.on_event, self.on_relist)


def run_lifecycle(
    settings: Settings,
    writer: Callable[[], MetaStore | None],
    stop: threading.Event,
    tasks: TaskScheduler,
    engine: Engine = "spark",
    gc_passes: Sequence[GcPass] = (),
) -> None:
    """The segment lifecycle beside a DataCoord while it is the active one (`writer()`:
    the store fenced by its term, None while standing by): each segment sorted as soon as
    its flush commits (a watch), a full scan for unsorted segments every
    VCHAN_SORT_SCAN_INTERVAL, the compaction check every VCHAN_COMPACTION_CHECK_INTERVAL,
    the whole step (plans, L0/mix compaction, GC) every VCHAN_LIFECYCLE_INTERVAL. Returns
    when `stop` is set. `tasks`: the scheduler that runs the sorts (and the kinds plugged
    into it); `gc_passes`: more garbage collection for the GC pass."""
    storage = Storage.from_settings(settings)
    queue = SortQueue()
    watcher: PrefixWatcher | None = None
    next_step = time.monotonic() + settings.lifecycle_interval
    next_scan = time.monotonic() + settings.sort_scan_interval
    next_check = time.monotonic() + settings.compaction_check_interval
    next_tasks = 0.0  # the scheduler's scan: at once in each term
    try:
        while not stop.is_set():
            store = writer()
            if watcher is not None and (store is None or watcher.store is not store):
                watcher.stop()  # the term ended: the next one watches with its own fence
                watcher = None
            if store is None:
                stop.wait(0.5)
                continue
            if watcher is None:
                watcher = queue.watch(store).start()
                next_tasks = 0.0
            waiting = queue.take(
                min(next_step, next_scan, next_check, time.monotonic() + 0.5) - time.monotonic()
            )
            if stop.is_set():
                break
            if waiting:
                failpoint("handoff_taken")  # the push arrived, no sort planned yet
            system = System(settings, store, storage)  # its writes fenced by this DataCoord's term
            try:
                next_tasks = _task_round(tasks, system, engine, waiting, next_tasks)
                if time.monotonic() >= next_scan:
                    next_scan = time.monotonic() + settings.sort_scan_interval
                    tasks.scan(system)
                if time.monotonic() >= next_step:
                    next_step = time.monotonic() + settings.lifecycle_interval
                    next_check = time.monotonic() + settings.compaction_check_interval
                    report = lifecycle_step(system, engine=engine, sort=False, gc_passes=gc_passes)
                    log.info("lifecycle step: %d planned, %d run", len(report.planned), len(report.outcomes))
                elif time.monotonic() >= next_check:
                    next_check = time.monotonic() + settings.compaction_check_interval
                    report = compaction_check(system, engine)
                    if done := [o for o in report.outcomes if o.state is PlanState.COMPLETED]:
                        log.info(
                            "compaction check: %d of %d plans completed", len(done), len(report.outcomes)
                        )
                        next_check = time.monotonic()  # more may wait (a plan takes 30 L0 segments at most)
            except (MetaError, StorageError, LogError) as exc:
                log.warning("lifecycle step failed (%s); trying again", exc)
                for collection_id, ids in waiting.items():  # not lost: the next round tries them again
                    queue.put(collection_id, ids)
                stop.wait(1.0)
    finally:
        if watcher is not None:
            watcher.stop()


# Seconds between the scheduler's rounds without a push, and scans of the kinds that
# follow another (index builds: CreateIndex makes builds the next scan queues).
TASK_SCAN_INTERVAL = 2.0
TASK_POLL_INTERVAL = 0.5


def _task_round(
    tasks: TaskScheduler, system: System, engine: Engine, waiting: dict[int, set[int]], next_tasks: float
) -> float:
    """A push queues its collections' sorts; a round runs what is queued. Returns when the
    next round without a push is due."""
    now = time.monotonic()
    if not waiting and now < next_tasks:
        return next_tasks
    if waiting:
        tasks.scan(system, set(waiting), [k.name for k in tasks.kinds if k.follows is None])
    if now >= next_tasks:
        tasks.scan(
            system, kinds=[k.name for k in tasks.kinds if k.follows is not None] if next_tasks else None
        )
    report = tasks.round(system, engine, wait=False)
    if report.ran or report.recovered:
        log.info(
            "tasks: ran %d, done %d, retried %d, failed %d, dead workers' %d",
            len(report.ran), len(report.done), len(report.retried), len(report.failed), len(report.recovered),
        )  # fmt: skip
    if report.waiting or report.recovered:
        return now  # more queued: the next round at once (a failed attempt waits its backoff)
    if tasks.busy:
        return now + TASK_POLL_INTERVAL  # a batch runs: record it soon after it ends
    return now + TASK_SCAN_INTERVAL
