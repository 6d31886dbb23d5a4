"""One DataCoord lifecycle step, the same whoever runs it (the `vchan datacoord` process
or the Dagster lifecycle assets): time out and clean up plans, trigger sort (the stats
task after flush) and mix compaction, run Pending plans, and garbage-collect once the
interval has passed.

`sort_step` is the stats task alone, for the seed's postFlush hand-off: the DataCoord runs
it as soon as a flush commits (`handoff.run_lifecycle`, pushed by a watch), the Dagster
`sorted_segments` asset on its sensor's tick."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.lifecycle.compaction import (
    CompactionExecutor,
    CompactionTrigger,
    PlanOutcome,
    cleanup_plan,
    sort_candidates,
)
from vchan_assets.lifecycle.gc import GarbageCollector, GcReport
from vchan_assets.lifecycle.plans import (
    FINISHED,
    CompactionType,
    PlanState,
    busy_segments,
    list_plans,
    transition,
)
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentInfo
from vchan_assets.spark import Engine
from vchan_assets.system import System

log = logging.getLogger(__name__)


@dataclass
class LifecycleReport:
    timed_out: list[int] = field(default_factory=list)
    cleaned: list[int] = field(default_factory=list)
    deleted_plans: list[int] = field(default_factory=list)
    planned: list[int] = field(default_factory=list)
    outcomes: list[PlanOutcome] = field(default_factory=list)
    gc: GcReport | None = None


def expire_plans(store: MetaStore, settings: Settings, now: float, report: LifecycleReport) -> None:
    """Executing past the timeout -> Failed (its executor died: its files are orphans);
    Completed/Failed -> Cleaned; Cleaned past the plan retention -> deleted."""
    for d in list_plans(store):
        p = d.model
        expired = p.state is PlanState.EXECUTING and now - p.started_at > settings.compaction_timeout
        if expired and transition(store, d, state=PlanState.FAILED, reason="timed out", finished_at=now):
            report.timed_out.append(p.plan_id)
    for d in list_plans(store):
        p = d.model
        if p.state in FINISHED and cleanup_plan(store, p.plan_id):
            report.cleaned.append(p.plan_id)
        elif p.state is PlanState.CLEANED and now - p.finished_at > settings.compaction_plan_retention:
            store.cas(d.kv.key, d.kv.version, None)
            report.deleted_plans.append(p.plan_id)


def lifecycle_step(
    system: System,
    engine: Engine = "spark",
    now: float | None = None,
    compact: bool = True,
    collect: bool = True,
) -> LifecycleReport:
    now = time.time() if now is None else now
    report = LifecycleReport()
    expire_plans(system.store, system.settings, now, report)
    if compact:
        # L0 first (deletes into the segments that hold their pks), then merge and sort:
        # a round of each, so neither keeps the other's segments busy forever.
        trigger = CompactionTrigger(system)
        executor = CompactionExecutor(system, engine)
        for kinds in ((CompactionType.L0,), (CompactionType.MIX, CompactionType.SORT)):
            for info in CollectionRegistry(system.store).list():
                for kind in kinds:
                    report.planned += [p.plan_id for p in trigger.trigger(info, kind)]
            report.outcomes += executor.run_pending()
    gc = GarbageCollector(system)
    if collect and gc.due():
        report.gc = gc.run()
    return report


def unsorted_segments(store: MetaStore, vchannel: str | None = None) -> list[SegmentInfo]:
    """Flushed L1 segments not sorted by pk and in no active plan (of `vchannel` if given):
    the stats task's work."""
    found, _ = store.list_models(store.keys.segment.prefix, SegmentInfo)
    if vchannel is not None:
        found = [d for d in found if d.model.vchannel == vchannel]
    busy = busy_segments(list_plans(store))
    return [c.segments[0].model for c in sort_candidates(found) if c.segments[0].model.id not in busy]


def sort_step(
    system: System,
    engine: Engine = "spark",
    vchannel: str | None = None,
    collections: Collection[int] | None = None,
) -> list[PlanOutcome]:
    """The stats task after flush: plan a sort of every unsorted flushed segment (of
    `vchannel` if given; of the `collections` given, which a push named, else of those a
    listing of all segment meta finds) and run those plans (one job)."""
    if collections is None:
        waiting = {s.collection_id for s in unsorted_segments(system.store, vchannel)}
    else:
        waiting = set(collections)
    if not waiting:
        return []
    trigger = CompactionTrigger(system)
    planned = [
        p.plan_id
        for info in CollectionRegistry(system.store).list()
        if info.id in waiting
        for p in trigger.trigger(info, CompactionType.SORT, vchannel=vchannel)
    ]
    return CompactionExecutor(system, engine).run_pending(planned) if planned else []
