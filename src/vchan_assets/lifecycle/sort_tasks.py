"""The sort (the stats task after flush) as a kind of the DataCoord's task scheduler
(`datacoord.tasks`): a task per unsorted flushed segment, run as sort plans of exactly
those segments (`sort_step(..., segments=...)`, one job per batch)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vchan_assets.datacoord.tasks import DEFERRED, DONE, Outcome, TaskSpec, failed
from vchan_assets.lifecycle.compaction import input_memory_mb
from vchan_assets.lifecycle.handoff import awaits_sort
from vchan_assets.lifecycle.plans import CompactionPlan, PlanState
from vchan_assets.lifecycle.step import release_orphaned_plans, sort_step, unsorted_segments
from vchan_assets.model import SegmentInfo, TaskRecord
from vchan_assets.spark import Engine
from vchan_assets.system import System


def sort_memory_mb(seg: SegmentInfo) -> float:
    return input_memory_mb([seg])


class SortTasks:
    name = "sort"
    follows: str | None = None

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
