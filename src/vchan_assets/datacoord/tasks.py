"""The DataCoord's one task scheduler (the seed's taskScheduler / indexNodeManager) for the
tasks that follow a segment's flush: its sort (the stats task) and its index builds.

What a task does is its kind's, plugged in from above (`lifecycle.sort_tasks.SortTasks`,
`indexes.tasks.IndexTasks`, composed where the DataCoord's loop is built); this module
keeps the queue:

- **Persisted**: one record per (kind, segment), `meta/task/{kind}/{collection}/{segment}`
  (`TaskRecord`: state, attempts, reason, worker, started_at). Adding a task creates the key
  only if it is absent, so a segment is never queued twice for a kind (dedupe). A done task
  is deleted; the queue is read from etcd at every round, so a restarted or new DataCoord
  carries on with it (reload).
- **Priority**: a queue per kind, run in the kinds' order (sort before index): a round
  runs the queued sorts first, then the index builds, and a sort waits at most for one
  round's index batch, never behind the whole index queue.
- **Admission**: a task takes one slot per million rows (at least one) of VCHAN_TASK_SLOTS
  and its kind's memory estimate of VCHAN_TASK_MEMORY_MB; a round admits tasks, oldest
  first in each kind, while both hold (a task over the whole budget runs alone).
- **Bounded retries**: a failed attempt goes back to the queue with its reason until
  VCHAN_TASK_MAX_ATTEMPTS attempts, then the task is Failed (shown by `vchan status`) until
  `retry` re-queues it (`vchan index --retry`).
- **Dead workers**: a task InProgress under another worker (a DataCoord that died, or
  whose term ended: the worker names its term) or past VCHAN_TASK_TIMEOUT goes back to the
  queue; its attempt counts, so a task that kills its worker every time ends Failed.

Every write is a compare-and-swap on the record's version, through the DataCoord's fenced
store: a deposed DataCoord changes no task.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from vchan_assets.config import Settings
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import SegmentInfo, SegmentState, TaskRecord, TaskState
from vchan_assets.spark import Engine
from vchan_assets.system import System

log = logging.getLogger(__name__)

ROWS_PER_SLOT = 1_000_000


class Outcome(NamedTuple):
    """What one task's attempt came to: done (the record is deleted), failed (an attempt
    spent, with the reason), or deferred (not runnable now, e.g. its segment is in another
    plan: back to the queue, no attempt spent)."""

    state: str  # "done", "failed", "deferred"
    reason: str = ""


DONE = Outcome("done")
DEFERRED = Outcome("deferred")


def failed(reason: str) -> Outcome:
    return Outcome("failed", reason[:2000])


@dataclass(frozen=True)
class TaskSpec:
    """A task to queue: its segment and size."""

    collection_id: int
    partition_id: int
    segment_id: int
    rows: int
    memory_mb: float

    @classmethod
    def of(cls, seg: SegmentInfo, memory_mb: float) -> TaskSpec:
        return cls(seg.collection_id, seg.partition_id, seg.id, seg.num_rows, memory_mb)


class TaskKind(Protocol):
    """A kind of task, plugged into the scheduler. `follows`: the kind whose done tasks
    push this kind's (the index builds follow the sort: its commit makes the segments they
    index)."""

    name: str
    follows: str | None

    def discover(self, system: System, collections: Collection[int] | None) -> list[TaskSpec]:
        """The tasks there are to queue (of `collections` if given)."""
        ...

    def run(self, system: System, engine: Engine, tasks: Sequence[TaskRecord]) -> dict[int, Outcome]:
        """Run these tasks (one batch); the outcome by segment id (missing: done)."""
        ...


def task_slots(rows: int) -> int:
    return max(1, math.ceil(rows / ROWS_PER_SLOT))


@dataclass
class RoundReport:
    queued: list[tuple[str, int]] = field(default_factory=list)  # (kind, segment) added
    ran: list[tuple[str, int]] = field(default_factory=list)  # in the order they ran
    done: list[tuple[str, int]] = field(default_factory=list)
    retried: list[tuple[str, int, str]] = field(default_factory=list)  # failed attempts re-queued
    failed: list[tuple[str, int, str]] = field(default_factory=list)  # out of attempts
    recovered: list[tuple[str, int]] = field(default_factory=list)  # dead workers' tasks re-queued
    waiting: int = 0  # queued tasks not admitted this round


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def list_tasks(store: MetaStore, kind: str | None = None) -> list[Decoded[TaskRecord]]:
    prefix = store.keys.task.prefix if kind is None else store.keys.task.under(kind)
    found, _ = store.list_models(prefix, TaskRecord, skip_malformed=True)
    return found


def task_key(store: MetaStore, t: TaskRecord) -> str:
    return store.keys.task(t.kind, t.collection_id, t.segment_id)


def swap_task(
    store: MetaStore, d: Decoded[TaskRecord], changed: TaskRecord | None
) -> Decoded[TaskRecord] | None:
    """`changed` (None: deleted) in place of `d` if it is unchanged; None if it was."""
    try:
        store.cas(d.kv.key, d.kv.version, changed)
    except CasConflictError:
        return None
    if changed is None:
        return d
    return store.get_model(d.kv.key, TaskRecord)


def enqueue_tasks(store: MetaStore, kind: str, specs: Iterable[TaskSpec]) -> list[int]:
    """Queue a task of `kind` for each spec whose segment has none (dedupe by key), from
    any process (the DataCoord's next round runs it). Returns the segments queued now."""
    queued = []
    now = time.time()
    for s in specs:
        record = TaskRecord(
            kind, s.collection_id, s.partition_id, s.segment_id, s.rows, s.memory_mb, created_at=now
        )
        try:
            store.cas(task_key(store, record), 0, record)
        except CasConflictError:
            continue  # queued already (or Failed: waits for a retry)
        queued.append(s.segment_id)
    return queued


def retry_tasks(store: MetaStore, kind: str, collection_id: int | None = None) -> list[TaskRecord]:
    """Failed tasks of `kind` (of one collection if given) back to the queue with their
    attempts reset (`vchan index --retry`). Returns them as re-queued."""
    again = []
    for d in list_tasks(store, kind):
        t = d.model
        if t.state is not TaskState.FAILED or collection_id not in (None, t.collection_id):
            continue
        fresh = replace(t, state=TaskState.QUEUED, attempts=0, worker="", started_at=0.0)
        if swap_task(store, d, fresh) is not None:
            again.append(fresh)
    return again


class TaskScheduler:
    """The queues of `kinds` (in priority order: the first runs first)."""

    def __init__(self, kinds: Sequence[TaskKind], settings: Settings) -> None:
        self.kinds = list(kinds)
        self.settings = settings

    def worker(self, store: MetaStore) -> str:
        """This process under the store's term (0: unfenced)."""
        return f"{this_process()}@{store.fence.create_revision if store.fence else 0}"

    # --- queueing -------------------------------------------------------------------

    def enqueue(self, store: MetaStore, kind: str, specs: Iterable[TaskSpec]) -> list[int]:
        """Queue a task of `kind` for each spec whose segment has none (dedupe by key).
        Returns the segments queued now."""
        return enqueue_tasks(store, kind, specs)

    def scan(
        self, system: System, collections: Collection[int] | None = None, kinds: Collection[str] | None = None
    ) -> list[tuple[str, int]]:
        """Every kind's discovery (of `kinds` if given): the periodic scan, and a push.
        The full scan also deletes the tasks whose segment is Dropped or gone from meta (a
        Failed task of a segment compacted or collected since)."""
        if collections is None and kinds is None:
            self.prune(system.store)
        queued = []
        for kind in self.kinds:
            if kinds is None or kind.name in kinds:
                specs = kind.discover(system, collections)
                queued += [(kind.name, s) for s in self.enqueue(system.store, kind.name, specs)]
        return queued

    def prune(self, store: MetaStore) -> list[TaskRecord]:
        """Delete the tasks whose segment is Dropped or gone from meta; returns them."""
        found, _ = store.list_models(store.keys.segment.prefix, SegmentInfo, skip_malformed=True)
        segments = {d.model.id for d in found if d.model.state is not SegmentState.DROPPED}
        gone = [d for d in list_tasks(store) if d.model.segment_id not in segments]
        return [d.model for d in gone if swap_task(store, d, None) is not None]

    # --- one round ------------------------------------------------------------------

    def round(self, system: System, engine: Engine) -> RoundReport:
        """Recover dead workers' tasks, then each kind in priority order: admit its queued
        tasks within what is left of the budget, run them as one batch, record their
        outcomes, and push the kinds that follow it."""
        report = RoundReport()
        store = system.store
        self.recover(store, report)
        slots, memory = self.settings.task_slots, self.settings.task_memory_mb
        admitted_any = False
        for kind in self.kinds:
            queued = sorted(
                (d for d in list_tasks(store, kind.name) if d.model.state is TaskState.QUEUED),
                key=lambda d: (d.model.created_at, d.model.segment_id),
            )
            batch: list[Decoded[TaskRecord]] = []
            for d in queued:
                need = task_slots(d.model.rows)
                if admitted_any and (need > slots or d.model.memory_mb > memory):
                    report.waiting += 1
                    continue
                slots, memory = slots - need, memory - d.model.memory_mb
                admitted_any = True
                batch.append(d)
            if batch:
                done = self._run(system, engine, kind, batch, report)
                if done:
                    for follower in self.kinds:
                        if follower.follows == kind.name:
                            report.queued += self.scan(system, done, {follower.name})
        return report

    def _run(
        self,
        system: System,
        engine: Engine,
        kind: TaskKind,
        batch: list[Decoded[TaskRecord]],
        report: RoundReport,
    ) -> set[int]:
        """Start, run and record one batch; the collections with a task done."""
        store = system.store
        worker, now = self.worker(store), time.time()
        started: list[Decoded[TaskRecord]] = []
        for d in batch:
            t = d.model
            mine = replace(
                t, state=TaskState.IN_PROGRESS, attempts=t.attempts + 1, worker=worker, started_at=now
            )
            if (found := swap_task(store, d, mine)) is not None:
                started.append(found)
        if not started:
            return set()
        report.ran += [(kind.name, d.model.segment_id) for d in started]
        try:
            outcomes = kind.run(system, engine, [d.model for d in started])
        except Exception as exc:  # the batch failed as a whole: an attempt of each
            log.exception("%s tasks %s failed", kind.name, [d.model.segment_id for d in started])
            outcomes = {d.model.segment_id: failed(f"{type(exc).__name__}: {exc}") for d in started}
        done: set[int] = set()
        for d in started:
            outcome = outcomes.get(d.model.segment_id, DONE)
            self._record(store, d, outcome, report)
            if outcome.state == "done":
                done.add(d.model.collection_id)
        return done

    def _record(
        self, store: MetaStore, d: Decoded[TaskRecord], outcome: Outcome, report: RoundReport
    ) -> None:
        t = d.model
        if outcome.state == "done":
            if swap_task(store, d, None) is not None:
                report.done.append((t.kind, t.segment_id))
            return
        if outcome.state == "deferred":
            swap_task(store, d, replace(t, state=TaskState.QUEUED, attempts=t.attempts - 1, worker=""))
            return
        self._spent(store, d, outcome.reason, report.retried, report.failed)

    def _spent(
        self,
        store: MetaStore,
        d: Decoded[TaskRecord],
        reason: str,
        retried: list[tuple[str, int, str]],
        failed_out: list[tuple[str, int, str]],
    ) -> bool:
        """An attempt failed: back to the queue, or Failed once out of attempts."""
        t = d.model
        out = t.attempts >= self.settings.task_max_attempts
        state = TaskState.FAILED if out else TaskState.QUEUED
        if swap_task(store, d, replace(t, state=state, reason=reason, worker="")) is None:
            return False
        (failed_out if out else retried).append((t.kind, t.segment_id, reason))
        if out:
            log.error("%s task of segment %d failed %d times: %s", t.kind, t.segment_id, t.attempts, reason)
        else:
            log.warning(
                "%s task of segment %d failed (attempt %d): %s", t.kind, t.segment_id, t.attempts, reason
            )
        return True

    def recover(self, store: MetaStore, report: RoundReport) -> None:
        """Tasks InProgress under another worker (dead, or of an ended term) or past
        VCHAN_TASK_TIMEOUT back to the queue (an attempt spent)."""
        me, now = self.worker(store), time.time()
        for d in list_tasks(store):
            t = d.model
            if t.state is not TaskState.IN_PROGRESS or (
                t.worker == me and now - t.started_at < self.settings.task_timeout
            ):
                continue
            reason = f"worker {t.worker} died or its term ended (started {now - t.started_at:.0f}s ago)"
            if self._spent(store, d, reason, report.retried, report.failed):
                report.recovered.append((t.kind, t.segment_id))
