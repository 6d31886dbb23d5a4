"""The DataCoord's one task scheduler (Milvus' taskScheduler / indexNodeManager) for the
tasks that follow a segment's flush: its sort (the stats task) and its index builds.

What a task does is its kind's, plugged in from above (`lifecycle.sort_tasks.SortTasks`,
`indexes.tasks.IndexTasks`, composed where the DataCoord's loop is built); this module
keeps the queue:

- **Persisted**: one record per (kind, segment), `meta/task/{kind}/{collection}/{segment}`
  (`TaskRecord`: state, attempts, reason, worker, started_at). Adding a task creates the key
  only if it is absent, so a segment is never queued twice for a kind (dedupe). A done task
  is deleted; the queue is read from etcd at every round, so a restarted or new DataCoord
  carries on with it (reload).
- **Priority**: a queue per kind, in the kinds' order (sort before index), each run in
  its own lane: a round starts a kind's next batch as soon as its previous one ended, so
  a sort never waits behind an index batch (builds of large segments take minutes), and
  the index builds hold at most half the budget, so a sort always finds room.
- **Admission**: a task takes one slot per million rows (at least one) of VCHAN_TASK_SLOTS
  and its kind's memory estimate of VCHAN_TASK_MEMORY_MB; a kind's batch takes its queued
  tasks, oldest first, while what the running batches leave holds them (a task over the
  whole budget runs alone). Compaction plans and import tasks, which run outside these
  queues, are admitted against the same budget by `memory_batches`: the ones that do not
  fit run in a later batch.
- **Bounded retries with backoff**: a failed attempt goes back to the queue with its
  reason, not to run again before `not_before`: VCHAN_TASK_RETRY_BACKOFF seconds after
  the first failure, doubled at each further one, at most VCHAN_TASK_RETRY_BACKOFF_MAX
  (a segment whose files are briefly unreadable, or a worker short of memory, is not
  retried at once into the same failure). After VCHAN_TASK_MAX_ATTEMPTS attempts the task
  is Failed (shown by `vchan status`), never for good: it goes back to the queue, its
  attempts reset, VCHAN_TASK_FAILED_RETRY seconds later (doubled each further time it ends
  Failed, at most a day), or at once by `retry` (`vchan tasks --retry`, `vchan index --retry`).
- **Dead workers**: a task InProgress under another worker (a DataCoord that died, or
  whose term ended: the worker names its term) or past VCHAN_TASK_TIMEOUT goes back to the
  queue at once (the worker's death, not the task's failure: no backoff). The first death
  spends no attempt (a DataCoord killed for its own reasons is not the task's fault), but
  the task then runs alone, in a batch of its own: a second death in a row while it ran
  alone points at the task, and from then on each death spends an attempt. So a task that
  kills its worker every time ends Failed after VCHAN_TASK_MAX_ATTEMPTS + 1 deaths, and
  one whose DataCoord was killed three times for other reasons still finishes.
- **Beside other schedulers**: a Dagster run is one process among several (a sort run, an
  index run, a partition materialized from the UI), so its scheduler is not `exclusive`: it
  runs rounds restricted to its kinds and to the segments of one vchannel (`round(...,
  segments=..., kinds=...)`), and takes over another worker's task only once `worker_gone`
  says that worker can no longer finish it (or past VCHAN_TASK_TIMEOUT). The records,
  attempts, backoff and Failed state are the same whoever runs the round.
- **Graceful stop**: a DataCoord stopping (SIGTERM) abandons its batches in flight before
  it resigns (`abandon`): their tasks go back to the queue at once, no attempt spent, and
  the process exits without waiting for them (the next active DataCoord runs them).

Every write is a compare-and-swap on the record's version, through the DataCoord's fenced
store: a deposed DataCoord changes no task.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, TypeVar

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import pid_alive
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import SegmentInfo, SegmentState, TaskRecord, TaskState
from vchan_assets.spark import Engine
from vchan_assets.system import System

log = logging.getLogger(__name__)

ROWS_PER_SLOT = 1_000_000
# seconds a deferred task (its segment in another plan) waits before it is tried again
DEFER_SECONDS = 5.0
# the longest wait before a Failed task is tried again on its own
FAILED_RETRY_MAX = 86_400.0

T = TypeVar("T")


class Outcome(NamedTuple):
    """What one task's attempt came to: done (the record is deleted), failed (an attempt
    spent, with the reason), or deferred (not runnable now, e.g. its segment is in another
    plan: back to the queue for DEFER_SECONDS, no attempt spent)."""

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


def memory_batches(items: Sequence[T], memory_mb: Callable[[T], float], budget_mb: float) -> list[list[T]]:
    """`items` in their order, cut into batches whose memory estimates sum to at most
    `budget_mb` (VCHAN_TASK_MEMORY_MB; an item over the whole budget runs alone): the
    admission of work run outside the scheduler's queue (compaction plans, import tasks),
    whose batches run one after the other."""
    batches: list[list[T]] = []
    used = 0.0
    for item in items:
        need = memory_mb(item)
        if not batches or used + need > budget_mb:
            batches.append([])
            used = 0.0
        batches[-1].append(item)
        used += need
    return batches


@dataclass
class RoundReport:
    queued: list[tuple[str, int]] = field(default_factory=list)  # (kind, segment) added
    ran: list[tuple[str, int]] = field(default_factory=list)  # in the order they ran
    done: list[tuple[str, int]] = field(default_factory=list)
    retried: list[tuple[str, int, str]] = field(default_factory=list)  # failed attempts re-queued
    failed: list[tuple[str, int, str]] = field(default_factory=list)  # out of attempts
    recovered: list[tuple[str, int]] = field(default_factory=list)  # dead workers' tasks re-queued
    waiting: int = 0  # queued tasks not admitted this round
    backing_off: int = 0  # queued tasks whose backoff after a failed attempt has not passed
    revived: list[tuple[str, int]] = field(default_factory=list)  # Failed tasks whose time came

    def merge(self, other: RoundReport) -> None:
        """`other`'s (a later round's) added to this report; counts of the last round."""
        for name in ("queued", "ran", "done", "retried", "failed", "recovered", "revived"):
            getattr(self, name).extend(getattr(other, name))
        self.waiting, self.backing_off = other.waiting, other.backing_off


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def worker_of(store: MetaStore) -> str:
    """What a task or a compaction plan records as the worker running it: this process
    under the store's DataCoord term (`host:pid@term`; term 0: an unfenced process, such as
    `vchan compact` or a Dagster run)."""
    return f"{this_process()}@{store.fence.create_revision if store.fence else 0}"


def worker_gone(store: MetaStore, worker: str) -> str:
    """Why `worker` (as `worker_of` names it) can no longer finish what it started: its
    DataCoord term ended (the election key is gone or was created again since), or its
    process on this host exited. "" while it may still, or nothing tells (a process without
    a term on another host: only the timeout does)."""
    process, _, term = worker.rpartition("@")
    host, _, pid = process.rpartition(":")
    if term.isdigit() and int(term):
        held = store.get(store.keys.datacoord_session())
        return (
            ""
            if held is not None and held.create_revision == int(term)
            else f"its DataCoord term {term} ended"
        )
    if host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid)):
        return f"its process {pid} exited"
    return ""


def held_back(t: TaskRecord, now: float) -> bool:
    """Whether `t` is not to run at `now`: Failed until its time to be tried again (for
    good with VCHAN_TASK_FAILED_RETRY=0, until `vchan tasks --retry`), or queued but backing
    off after a failed attempt (or deferred). What a caller that asks for rounds (Dagster's
    sensors) leaves out, so a failing segment is not asked for at every tick."""
    if t.state is TaskState.FAILED:
        return not 0.0 < t.not_before <= now
    return t.state is TaskState.QUEUED and t.not_before > now


def held_tasks(store: MetaStore, kind: str, segments: Collection[int], now: float) -> list[TaskRecord]:
    """The tasks of `kind` of `segments` held back at `now` (`held_back`), by segment id."""
    held = [d.model for d in list_tasks(store, kind) if d.model.segment_id in segments]
    return sorted((t for t in held if held_back(t, now)), key=lambda t: t.segment_id)


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


def enqueue_tasks(
    store: MetaStore, kind: str, specs: Iterable[TaskSpec], now: float | None = None
) -> list[int]:
    """Queue a task of `kind` for each spec whose segment has none (dedupe by key), from
    any process (the DataCoord's next round runs it), created at `now` (default: the
    time). Returns the segments queued now."""
    queued = []
    now = time.time() if now is None else now
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


def _requeued(t: TaskRecord) -> TaskRecord:
    """A Failed task back to the queue with its attempts reset."""
    return replace(t, state=TaskState.QUEUED, attempts=0, deaths=0, worker="", started_at=0.0, not_before=0.0)


def retry_tasks(store: MetaStore, kind: str | None, collection_id: int | None = None) -> list[TaskRecord]:
    """Failed tasks of `kind` (every kind's if None; of one collection if given) back to
    the queue with their attempts reset (`vchan tasks --retry`, `vchan index --retry`).
    Returns them as re-queued."""
    again = []
    for d in list_tasks(store, kind):
        t = d.model
        if t.state is not TaskState.FAILED or collection_id not in (None, t.collection_id):
            continue
        if swap_task(store, d, fresh := _requeued(t)) is not None:
            again.append(fresh)
    return again


def prune_tasks(store: MetaStore) -> list[TaskRecord]:
    """Delete the tasks whose segment is Dropped or gone from meta (a Failed task of a
    segment compacted or collected since): the full scan's, and Dagster's lifecycle step's.
    Returns them."""
    tasks = list_tasks(store)
    live: set[tuple[int, int]] = set()
    for collection in {d.model.collection_id for d in tasks}:  # none: no segment read
        found = SegmentMeta(store).list(collection, skip_malformed=True)
        live.update((collection, d.model.id) for d in found if d.model.state is not SegmentState.DROPPED)
    gone = [d for d in tasks if (d.model.collection_id, d.model.segment_id) not in live]
    return [d.model for d in gone if swap_task(store, d, None) is not None]


def queue_once(store: MetaStore, kind: str, spec: TaskSpec) -> bool:
    """`spec`'s task queued unless it is queued or running already; a Failed one goes back
    to the queue with its attempts reset (what it failed on changed). Whether it is queued
    now (False: it was, or runs: a running batch's outcome decides)."""
    for _ in range(3):
        if enqueue_tasks(store, kind, [spec]):
            return True
        found = store.get_model(store.keys.task(kind, spec.collection_id, spec.segment_id), TaskRecord)
        if found is None:
            continue  # done and deleted meanwhile: queue it again
        if found.model.state is not TaskState.FAILED:
            return False
        if swap_task(store, found, _requeued(found.model)) is not None:
            return True
    return False


@dataclass(frozen=True)
class _Selection:
    """The tasks a round works on: of these segments and kinds (None: all of them)."""

    segments: Collection[int] | None = None
    kinds: Collection[str] | None = None

    def has_kind(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def has(self, t: TaskRecord) -> bool:
        return self.has_kind(t.kind) and (self.segments is None or t.segment_id in self.segments)


@dataclass
class _Lane:
    """One kind's batch, run in its own thread; its outcomes, recorded by a later round."""

    kind: TaskKind
    system: System
    started: list[Decoded[TaskRecord]]
    thread: threading.Thread = field(init=False)
    outcomes: dict[int, Outcome] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return sum(task_slots(d.model.rows) for d in self.started)

    @property
    def memory_mb(self) -> float:
        return sum(d.model.memory_mb for d in self.started)

    def run(self, engine: Engine) -> None:
        tasks = [d.model for d in self.started]
        try:
            self.outcomes = self.kind.run(self.system, engine, tasks)
        except Exception as exc:  # the batch failed as a whole: an attempt of each
            log.exception("%s tasks %s failed", self.kind.name, [t.segment_id for t in tasks])
            self.outcomes = {t.segment_id: failed(f"{type(exc).__name__}: {exc}") for t in tasks}


class TaskScheduler:
    """The queues of `kinds` (in priority order: the first runs first). `clock`: the wall
    clock that starts, times out and backs off tasks. `exclusive`: the only scheduler
    running (the active DataCoord): a task InProgress under another worker is a dead one's.
    Otherwise (a Dagster run, beside other runs) only once `worker_gone` says so."""

    def __init__(
        self,
        kinds: Sequence[TaskKind],
        settings: Settings,
        clock: Callable[[], float] = time.time,
        exclusive: bool = True,
    ) -> None:
        self.kinds = list(kinds)
        self.settings = settings
        self.exclusive = exclusive
        self._lanes: dict[str, _Lane] = {}  # the batch running per kind
        self._abandoned: list[_Lane] = []  # given up by a stop, maybe still running
        self._stopped = False  # `abandon` was called: no batch starts any more
        self._starting = threading.Lock()  # a batch starts, or the stop gives the lanes up
        self.clock = clock

    def backoff(self, attempts: int) -> float:
        """Seconds a task waits after its `attempts`-th attempt failed."""
        base, most = self.settings.task_retry_backoff, self.settings.task_retry_backoff_max
        return min(most, base * 2.0 ** min(max(attempts - 1, 0), 60))

    def worker(self, store: MetaStore) -> str:
        """This process under the store's term (0: unfenced)."""
        return worker_of(store)

    # --- queueing -------------------------------------------------------------------

    def enqueue(self, store: MetaStore, kind: str, specs: Iterable[TaskSpec]) -> list[int]:
        """Queue a task of `kind` for each spec whose segment has none (dedupe by key).
        Returns the segments queued now."""
        return enqueue_tasks(store, kind, specs, self.clock())

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
        return prune_tasks(store)

    # --- one round ------------------------------------------------------------------

    def run_now(
        self, system: System, engine: Engine, segments: Collection[int], kinds: Collection[str] | None = None
    ) -> RoundReport:
        """Rounds of the tasks of `segments` (and `kinds`) only, each batch run to its end,
        until none of them is admitted any more (what one round's budget left waits for the
        next): the work of a Dagster run over one vchannel. A task held back (backing off,
        Failed) is not run; one whose time came is. Returns the rounds' reports merged."""
        total = RoundReport()
        while True:
            report = self.round(system, engine, wait=True, segments=segments, kinds=kinds)
            total.merge(report)
            if not report.waiting or not report.ran:
                return total

    def round(
        self,
        system: System,
        engine: Engine,
        wait: bool = True,
        segments: Collection[int] | None = None,
        kinds: Collection[str] | None = None,
    ) -> RoundReport:
        """Recover dead workers' tasks and record the batches that ended, then each kind in
        priority order whose lane is free: admit its queued tasks within what is left of
        the budget and run them as one batch in its lane. `wait`: each batch runs to its
        end before the next kind is admitted (and its done tasks push the kinds that
        follow it); otherwise the batches run in the background and a later round records
        them (the DataCoord's loop: a long index batch never holds up the next sort).
        `segments`, `kinds`: only the tasks of these segments and kinds are recovered,
        revived and run (a Dagster run's round over one vchannel)."""
        report = RoundReport()
        if self._stopped:
            return report  # the task loop's last round, after the stop gave its lanes up
        mine = _Selection(segments, kinds)
        self.recover(system.store, report, mine)
        self.revive(system.store, report, mine)
        self.collect(report)
        for kind in self.kinds:
            if kind.name in self._lanes or not mine.has_kind(kind.name):
                continue
            batch = self._admit(system.store, kind, report, mine)
            if batch and (lane := self._start(system, engine, kind, batch, report)) is not None and wait:
                lane.thread.join()
                self.collect(report)
        return report

    @property
    def abandoned_running(self) -> bool:
        """Whether a batch `abandon` gave up is still running (in native code: a faiss
        build cannot be interrupted, and the interpreter's normal exit would abort under
        it, so the process ends with `os._exit`)."""
        return any(lane.thread.is_alive() for lane in self._abandoned)

    @property
    def busy(self) -> list[str]:
        """The kinds whose batch is running."""
        return list(self._lanes)

    def _admit(
        self, store: MetaStore, kind: TaskKind, report: RoundReport, mine: _Selection
    ) -> list[Decoded[TaskRecord]]:
        """Queued tasks of `kind`, oldest first, while the budget the running batches leave
        holds them. A kind after the first may hold at most half the budget, so the first
        (the sort) always finds room. A task over what is left runs alone."""
        held = list(self._lanes.values())
        slots = self.settings.task_slots - sum(lane.slots for lane in held)
        memory = self.settings.task_memory_mb - sum(lane.memory_mb for lane in held)
        if kind is not self.kinds[0]:
            slots = min(slots, max(1, self.settings.task_slots // 2))
            memory = min(memory, self.settings.task_memory_mb / 2)
        queued = sorted(
            (
                d
                for d in list_tasks(store, kind.name)
                if d.model.state is TaskState.QUEUED and mine.has(d.model)
            ),
            key=lambda d: (d.model.created_at, d.model.segment_id),
        )
        now = self.clock()
        report.backing_off += sum(1 for d in queued if d.model.not_before > now)
        batch: list[Decoded[TaskRecord]] = []
        for d in (d for d in queued if d.model.not_before <= now):
            if d.model.deaths and (batch or held):  # a suspect runs alone
                report.waiting += 1
                continue
            need = task_slots(d.model.rows)
            if (batch or held) and (need > slots or d.model.memory_mb > memory):
                report.waiting += 1
                continue
            slots, memory = slots - need, memory - d.model.memory_mb
            batch.append(d)
            if d.model.deaths:
                break
        return batch

    def _start(
        self,
        system: System,
        engine: Engine,
        kind: TaskKind,
        batch: list[Decoded[TaskRecord]],
        report: RoundReport,
    ) -> _Lane | None:
        """Mark the batch InProgress under this worker and run it in its lane's thread;
        nothing once a stop called `abandon` (the stop's thread and the task loop's race:
        a batch is either started and given up, or not started)."""
        with self._starting:
            if self._stopped:
                return None
            worker, now = self.worker(system.store), self.clock()
            started: list[Decoded[TaskRecord]] = []
            for d in batch:
                t = d.model
                mine = replace(
                    t,
                    state=TaskState.IN_PROGRESS,
                    attempts=t.attempts + 1,
                    worker=worker,
                    started_at=now,
                    not_before=0.0,
                )
                if (found := swap_task(system.store, d, mine)) is not None:
                    started.append(found)
            if not started:
                return None
            report.ran += [(kind.name, d.model.segment_id) for d in started]
            lane = _Lane(kind, system, started)
            lane.thread = threading.Thread(
                target=lane.run, args=(engine,), name=f"tasks-{kind.name}", daemon=True
            )
            self._lanes[kind.name] = lane
        lane.thread.start()
        return lane

    def collect(self, report: RoundReport) -> None:
        """Record the outcomes of the batches that ended, and push the kinds that follow
        theirs with the collections that had a task done."""
        for name, lane in list(self._lanes.items()):
            if lane.thread.is_alive() or self._lanes.pop(name, None) is not lane:
                continue  # running, or abandoned meanwhile
            store = lane.system.store  # the term the batch started in: a deposed one writes nothing
            done: set[int] = set()
            for d in lane.started:
                outcome = lane.outcomes.get(d.model.segment_id, DONE)
                self._record(store, d, outcome, report)
                if outcome.state == "done":
                    done.add(d.model.collection_id)
            if done:
                followers = {k.name for k in self.kinds if k.follows == name}
                if followers:
                    report.queued += self.scan(lane.system, done, followers)

    def _record(
        self, store: MetaStore, d: Decoded[TaskRecord], outcome: Outcome, report: RoundReport
    ) -> None:
        t = d.model
        if outcome.state == "done":
            if swap_task(store, d, None) is not None:
                report.done.append((t.kind, t.segment_id))
            return
        if outcome.state == "deferred":  # not its turn: no attempt spent, and no busy loop
            not_before = self.clock() + DEFER_SECONDS
            swap_task(
                store,
                d,
                replace(t, state=TaskState.QUEUED, attempts=t.attempts - 1, worker="", not_before=not_before),
            )
            return
        ended = Decoded(replace(t, deaths=0), d.kv)  # its worker lived through it: deaths in a row end
        self._spent(store, ended, outcome.reason, report.retried, report.failed, self.backoff(t.attempts))

    def _spent(
        self,
        store: MetaStore,
        d: Decoded[TaskRecord],
        reason: str,
        retried: list[tuple[str, int, str]],
        failed_out: list[tuple[str, int, str]],
        backoff: float = 0.0,
    ) -> bool:
        """An attempt failed: back to the queue (not run again for `backoff` seconds), or
        Failed once out of attempts."""
        t = d.model
        out = t.attempts >= self.settings.task_max_attempts
        if out:
            changed = replace(
                t,
                state=TaskState.FAILED,
                reason=reason,
                worker="",
                failures=t.failures + 1,
                not_before=self._revival(t.failures + 1),
            )
        else:
            not_before = self.clock() + backoff if backoff else 0.0
            changed = replace(t, state=TaskState.QUEUED, reason=reason, worker="", not_before=not_before)
        if swap_task(store, d, changed) is None:
            return False
        (failed_out if out else retried).append((t.kind, t.segment_id, reason))
        if out:
            log.error("%s task of segment %d failed %d times: %s", t.kind, t.segment_id, t.attempts, reason)
        else:
            log.warning(
                "%s task of segment %d failed (attempt %d, next in %.0fs): %s",
                t.kind, t.segment_id, t.attempts, backoff, reason,
            )  # fmt: skip
        return True

    def _revival(self, failures: int) -> float:
        """When a task Failed for the `failures`-th time goes back to the queue on its own
        (0.0: never, VCHAN_TASK_FAILED_RETRY=0)."""
        base = self.settings.task_failed_retry
        return self.clock() + min(FAILED_RETRY_MAX, base * 2.0 ** min(failures - 1, 30)) if base else 0.0

    def revive(self, store: MetaStore, report: RoundReport, mine: _Selection | None = None) -> None:
        """Failed tasks (of `mine` if given) whose time to be tried again came: back to the
        queue, attempts reset."""
        now, mine = self.clock(), mine or _Selection()
        for d in list_tasks(store):
            t = d.model
            due = t.state is TaskState.FAILED and 0.0 < t.not_before <= now and mine.has(t)
            if due and swap_task(store, d, _requeued(t)) is not None:
                log.info(
                    "%s task of segment %d tried again (Failed %d times)", t.kind, t.segment_id, t.failures
                )
                report.revived.append((t.kind, t.segment_id))

    def abandon(self, store: MetaStore, reason: str) -> list[tuple[str, int]]:
        """The DataCoord is stopping: every batch in flight is given up, its tasks back to
        the queue for the next active DataCoord, with no attempt spent (the task did not
        fail), through `store` (the ending term's, before it resigns); no batch starts
        after it. The batches' threads
        run on unrecorded: their commits are refused once the term has ended, and a build
        the next DataCoord starts again gets a new version. Returns the tasks given up."""
        given_up = []
        with self._starting:
            self._stopped = True
            lanes = [self._lanes.pop(name) for name in list(self._lanes)]
        for lane in lanes:
            self._abandoned.append(lane)
            for d in lane.started:
                t = d.model
                back = replace(
                    t, state=TaskState.QUEUED, attempts=max(t.attempts - 1, 0), worker="", reason=reason
                )
                if swap_task(store, d, back) is not None:
                    given_up.append((t.kind, t.segment_id))
        if given_up:
            log.warning("abandoned %d tasks in flight (%s): %s", len(given_up), reason, given_up)
        return given_up

    def recover(self, store: MetaStore, report: RoundReport, mine: _Selection | None = None) -> None:
        """Tasks (of `mine` if given) InProgress under another worker (dead, or of an ended
        term; when not `exclusive`, only once `worker_gone` says so) or past
        VCHAN_TASK_TIMEOUT back to the queue (an attempt spent)."""
        me, now, mine = self.worker(store), self.clock(), mine or _Selection()
        lanes = dict(self._lanes)  # (a stop may abandon them meanwhile)
        running = {(name, d.model.segment_id) for name, lane in lanes.items() for d in lane.started}
        gone: dict[str, str] = {}  # by worker: one look per worker, not per task
        for d in list_tasks(store):
            t = d.model
            if (t.kind, t.segment_id) in running and lanes[t.kind].thread.is_alive():
                continue  # its batch runs in this process: recorded when it ends
            if t.state is not TaskState.IN_PROGRESS or not mine.has(t):
                continue
            timed_out = now - t.started_at >= self.settings.task_timeout
            if not timed_out and (t.worker == me or not self._gone(store, t.worker, gone)):
                continue
            reason = f"worker {t.worker} died or its term ended (started {now - t.started_at:.0f}s ago)"
            if self._died(store, d, reason, report):
                report.recovered.append((t.kind, t.segment_id))

    def _gone(self, store: MetaStore, worker: str, seen: dict[str, str]) -> bool:
        """Whether another worker can no longer finish its tasks: always, for the only
        scheduler (`exclusive`); else as `worker_gone` tells (asked once per worker)."""
        if self.exclusive:
            return True
        if worker not in seen:
            seen[worker] = worker_gone(store, worker)
        return bool(seen[worker])

    def _died(self, store: MetaStore, d: Decoded[TaskRecord], reason: str, report: RoundReport) -> bool:
        """The worker running `d` died: back to the queue, to run alone next; the attempt it
        started is spent only if its worker died under it the time before too (see the
        module's "Dead workers")."""
        t = d.model
        again = replace(t, deaths=t.deaths + 1)
        if not t.deaths:  # the first death in a row: not the task's fault
            again = replace(again, attempts=max(t.attempts - 1, 0))
        log.warning(
            "%s task of segment %d: %s (its %d death in a row)", t.kind, t.segment_id, reason, again.deaths
        )
        return self._spent(store, Decoded(again, d.kv), reason, report.retried, report.failed)
