"""The sort (the stats task after flush) as a kind of the DataCoord's task scheduler
(`datacoord.tasks`): a task per unsorted flushed segment, run as sort plans of exactly
those segments (`sort_step(..., segments=...)`, one job per batch).

`sort_vchannel` is the sort of one vchannel's segments through the same tasks from a
process beside others (Dagster's `sorted_segments`): the same records, attempts, backoff
and Failed state as in `vchan datacoord`."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from vchan_assets.datacoord.tasks import (
    DEFERRED,
    DONE,
    Outcome,
    RoundReport,
    TaskScheduler,
    TaskSpec,
    failed,
    held_back,
    held_tasks,
    list_tasks,
)
from vchan_assets.lifecycle.compaction import PlanOutcome, input_memory_mb
from vchan_assets.lifecycle.handoff import awaits_sort
from vchan_assets.lifecycle.plans import CompactionPlan, PlanState
from vchan_assets.lifecycle.step import release_orphaned_plans, sort_step, unsorted_segments
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentInfo, TaskRecord
from vchan_assets.spark import Engine
from vchan_assets.system import System


def sort_memory_mb(seg: SegmentInfo) -> float:
    return input_memory_mb([seg])


KIND = "sort"


class SortTasks:
    """`on_plans`: told the outcomes of each batch's sort plans (what a Dagster run reports)."""

    name = KIND
    follows: str | None = None
    on_plans: Callable[[list[PlanOutcome]], None] | None = None

    def __init__(self, on_plans: Callable[[list[PlanOutcome]], None] | None = None) -> None:
        self.on_plans = on_plans

    def discover(self, system: System, collections: Collection[int] | None) -> list[TaskSpec]:
        return [
            TaskSpec.of(s, sort_memory_mb(s))
            for s in unsorted_segments(system.store)
            if collections is None or s.collection_id in collections
        ]

    def run(self, system: System, engine: Engine, tasks: Sequence[TaskRecord]) -> dict[int, Outcome]:
        segments = {t.segment_id for t in tasks}
        release_orphaned_plans(system.store, segments)  # a dead DataCoord's sorts of them
        outcomes = sort_step(
            system,
            engine,
            collections={t.collection_id for t in tasks},
            segments=segments,
        )
        if self.on_plans is not None:
            self.on_plans(outcomes)
        store = system.store
        failures: dict[int, str] = {}
        for o in outcomes:
            plan = store.get_model(store.keys.compaction_plan(o.plan_id), CompactionPlan)
            if o.state is PlanState.FAILED and plan is not None:
                failures.update({i.segment_id: o.reason for i in plan.model.inputs})
        result: dict[int, Outcome] = {}
        for t in tasks:
            found = store.get_model(
                store.keys.segment(t.collection_id, t.partition_id, t.segment_id), SegmentInfo
            )
            if found is None or not awaits_sort(found.model):
                result[t.segment_id] = DONE  # sorted (its output replaced it), or gone
            elif t.segment_id in failures:
                result[t.segment_id] = failed(failures[t.segment_id] or "the sort plan failed")
            else:
                result[t.segment_id] = DEFERRED  # in another plan meanwhile: not this task's turn
        return result


@dataclass
class SortRound:
    """What one vchannel's sort through the task scheduler did: the sort plans it ran, the
    rounds' report, and its segments' tasks held back after it (Failed, or backing off: not
    run before their `not_before`)."""

    plans: list[PlanOutcome] = field(default_factory=list)
    report: RoundReport = field(default_factory=RoundReport)
    held: list[TaskRecord] = field(default_factory=list)


def sort_vchannel(system: System, engine: Engine, waiting: Sequence[SegmentInfo]) -> SortRound:
    """The stats task of `waiting` (one vchannel's unsorted segments, as listed by
    `unsorted_segments`) through the DataCoord's task scheduler, from a process that is one
    of several (a Dagster run: not `exclusive`): a sort task queued for each segment that has
    none, then rounds of those tasks only. A task backing off or Failed is not run before its
    time (its record says when); one whose time came is revived and run."""
    if not waiting:
        return SortRound()
    found = SortRound()
    kind = SortTasks(on_plans=found.plans.extend)
    scheduler = TaskScheduler([kind], system.settings, exclusive=False)
    ids = {s.id for s in waiting}
    scheduler.enqueue(system.store, KIND, [TaskSpec.of(s, sort_memory_mb(s)) for s in waiting])
    found.report = scheduler.run_now(system, engine, ids)
    found.held = held_tasks(system.store, KIND, ids, time.time())
    return found


def sorts_due(store: MetaStore, now: float) -> list[tuple[SegmentInfo, int]]:
    """The unsorted segments whose sort may run at `now`, each with its task's etcd
    revision (0: no task yet): those whose task is backing off or Failed are left out
    until their time (what Dagster's sort sensor asks runs for)."""
    tasks = {d.model.segment_id: d for d in list_tasks(store, KIND)}
    due = []
    for s in unsorted_segments(store):
        task = tasks.get(s.id)
        if task is None or not held_back(task.model, now):
            due.append((s, task.kv.mod_revision if task is not None else 0))
    return due
