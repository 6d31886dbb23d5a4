"""One DataCoord lifecycle step, the same whoever runs it (the `vchan datacoord` process
or the Dagster lifecycle assets): time out and clean up plans, trigger sort (the stats
task after flush) and mix compaction, run Pending plans, and garbage-collect once the
interval has passed. As Milvus' switches do, two settings turn compaction (VCHAN_COMPACTION_ENABLED)
and garbage collection (VCHAN_GC_ENABLED) off.

`compaction_check` is the cheap part of it the DataCoord runs in between (every
VCHAN_COMPACTION_CHECK_INTERVAL): L0 compaction of partitions past a count or size of L0
segments, mix compaction of small segments, as Milvus triggers them.

`sort_step` is the stats task alone, for Milvus' DataCoord postFlush hand-off: the DataCoord runs
it as soon as a flush commits (pushed by a watch, `handoff.run_lifecycle`, through its task
scheduler's sort tasks, `sort_tasks.py`), the Dagster `sorted_segments` asset on its
sensor's tick."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.tasks import held_back, list_tasks, worker_gone
from vchan_assets.lifecycle.compaction import (
    CompactionExecutor,
    CompactionTrigger,
    PlanOutcome,
    cleanup_plan,
    sort_candidates,
)
from vchan_assets.lifecycle.gc import GarbageCollector, GcPass, GcReport
from vchan_assets.lifecycle.plans import (
    FINISHED,
    CompactionType,
    PlanState,
    busy_segments,
    list_plans,
    transition,
)
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentInfo
from vchan_assets.spark import Engine
from vchan_assets.system import System

log = logging.getLogger(__name__)


@dataclass
class LifecycleReport:
    timed_out: list[int] = field(default_factory=list)
    orphaned: list[int] = field(default_factory=list)  # their worker was gone
    cleaned: list[int] = field(default_factory=list)
    deleted_plans: list[int] = field(default_factory=list)
    planned: list[int] = field(default_factory=list)
    outcomes: list[PlanOutcome] = field(default_factory=list)
    gc: GcReport | None = None


def release_orphaned_plans(
    store: MetaStore, segments: Collection[int] | None = None, now: float | None = None
) -> list[int]:
    """Executing plans (holding any of `segments` if given) whose worker is gone (its
    DataCoord term ended, its process exited: `worker_gone`) -> Failed and Cleaned at once:
    their segments are free for new plans, their files orphans for GC. Returns them."""
    now = time.time() if now is None else now
    released = []
    gone: dict[str, str] = {}  # by worker: one read of the election key per worker, not per plan
    for d in list_plans(store):
        p = d.model
        if p.state is not PlanState.EXECUTING or not p.worker:
            continue
        if segments is not None and not set(p.reserved) & set(segments):
            continue
        if p.worker not in gone:
            gone[p.worker] = worker_gone(store, p.worker)
        if not (why := gone[p.worker]):
            continue
        reason = f"worker {p.worker} is gone: {why}"
        if transition(store, d, state=PlanState.FAILED, reason=reason, finished_at=now) is not None:
            log.warning("compaction plan %d failed: %s", p.plan_id, reason)
            cleanup_plan(store, p.plan_id)
            released.append(p.plan_id)
    return released


def expire_plans(store: MetaStore, settings: Settings, now: float, report: LifecycleReport) -> None:
    """Executing past the timeout, or whose worker is gone -> Failed (its files are
    orphans); Completed/Failed -> Cleaned; Cleaned past the plan retention -> deleted."""
    report.orphaned += release_orphaned_plans(store, now=now)
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
    sort: bool = True,
    gc_passes: Sequence[GcPass] = (),
    sort_grace: float = 0.0,
) -> LifecycleReport:
    """`sort`: plan sorts too (False where the task scheduler runs them); `sort_grace`: sort
    (or merge) only the unsorted segments flushed at least this many seconds ago, the ones the
    stats task that runs right after flush did not get to (Dagster's sort sensor: a fresh flush is its, so
    its sort shows as `sorted_segments`); `gc_passes`: more garbage collection run by the GC
    pass (the index files')."""
    now = time.time() if now is None else now
    report = LifecycleReport()
    expire_plans(system.store, system.settings, now, report)
    if compact:
        then = (CompactionType.MIX, CompactionType.SORT) if sort else (CompactionType.MIX,)
        flushed_before = now - sort_grace if sort_grace else None
        _compact(system, engine, report, then, flushed_before=flushed_before, now=now)
    gc = GarbageCollector(system, passes=gc_passes)
    if collect and system.settings.gc_enabled and gc.due():
        report.gc = gc.run()
    return report


def compaction_check(system: System, engine: Engine = "spark") -> LifecycleReport:
    """The cheap check between lifecycle steps (every VCHAN_COMPACTION_CHECK_INTERVAL):
    L0 compaction of the partitions past VCHAN_L0_COMPACTION_TRIGGER_COUNT or _MB, mix
    compaction of small segments of one size tier, so compaction keeps up with ingest
    instead of waiting for VCHAN_LIFECYCLE_INTERVAL. Only the plans it made are run."""
    report = LifecycleReport()
    _compact(system, engine, report, (CompactionType.MIX,), check=True)
    return report


def _compact(
    system: System,
    engine: Engine,
    report: LifecycleReport,
    then: tuple[CompactionType, ...],
    check: bool = False,
    flushed_before: float | None = None,
    now: float | None = None,
) -> None:
    """L0 compaction first (deletes into the segments that hold their pks), then the kinds
    `then`: a round of each, so neither keeps the other's segments busy forever. A round
    runs every plan it made (as one job), the chained links of L0 plans after. A segment
    whose sort task backs off or is Failed at `now` goes in no sort or mix plan.

    VCHAN_COMPACTION_ENABLED=off plans no L0 or mix compaction: only the sort is left (it
    is the stats task after flush, which makes segments visible, not a compaction)."""
    trigger = CompactionTrigger(system)
    executor = CompactionExecutor(system, engine)
    now = time.time() if now is None else now
    # Segments whose sort task backs off or is Failed: no leftover sort or mix retries them
    # before the scheduler does ("sort": `sort_tasks.KIND`, which imports this module).
    held = {d.model.segment_id for d in list_tasks(system.store, "sort") if held_back(d.model, now)}
    rounds = [(CompactionType.L0,), then]
    if not system.settings.compaction_enabled:
        rounds = [tuple(k for k in kinds if k is CompactionType.SORT) for kinds in rounds]
    for kinds in filter(None, rounds):
        planned = [
            p.plan_id
            for info in CollectionRegistry(system.store).list()
            for kind in kinds
            for p in trigger.trigger(info, kind, check=check, flushed_before=flushed_before, held=held)
        ]
        report.planned += planned
        if not check:
            report.outcomes += executor.run_pending()  # Pending plans an earlier step left too
        elif planned:
            report.outcomes += executor.run_pending(planned)


def unsorted_segments(store: MetaStore, vchannel: str | None = None) -> list[SegmentInfo]:
    """Flushed L1 segments not sorted by pk and in no active plan (of `vchannel` if given):
    the stats task's work."""
    found = SegmentMeta(store).list()
    if vchannel is not None:
        found = [d for d in found if d.model.vchannel == vchannel]
    busy = busy_segments(list_plans(store))
    return [c.segments[0].model for c in sort_candidates(found) if c.segments[0].model.id not in busy]


def sort_step(
    system: System,
    engine: Engine = "spark",
    vchannel: str | None = None,
    collections: Collection[int] | None = None,
    segments: Collection[int] | None = None,
) -> list[PlanOutcome]:
    """The stats task after flush: plan a sort of every unsorted flushed segment (of
    `vchannel` if given; of the `collections` given, which a push named, else of those a
    listing of all segment meta finds; only of `segments` if given: the scheduler's tasks)
    and run those plans (one job)."""
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
        for p in trigger.trigger(info, CompactionType.SORT, vchannel=vchannel, segments=segments)
    ]
    return CompactionExecutor(system, engine).run_pending(planned) if planned else []
