"""Index builds as a kind of the DataCoord's task scheduler (`datacoord.tasks`).

One task per segment with builds to run (of every live index of its collection); the
builds themselves stay the `SegmentIndex` records with their own states (Unissued ->
InProgress -> Finished / Failed): the task only adds what the queue needs (attempts,
worker, priority, admission), and is deleted once every build of its segment is Finished.
The kind follows the sort: a sort's commit makes sorted segments, and the scheduler
queues their builds at once (`discover` of the sorts' collections, which creates the
missing builds first).

`retry_failed_builds` is `vchan index --retry`: Failed builds back to Unissued and their
Failed tasks back to the queue with their attempts reset. `upgrade_builds` is `vchan index
--upgrade`: Finished builds of an older engine version than builds now write back to
Unissued, each segment's task queued. `queue_rebuild` is a search's: a build whose file is
missing or unreadable, once (of two searches that find it, one re-issues it; the task is
queued once, deduped by its key). `rebuild_segment` is `vchan quarantine`'s, given a
damaged binlog: the segment's rows changed under its builds, every one of them is reset and
its task queued once.

`build_vchannel` is one vchannel's builds through the same tasks from a process beside
others (Dagster's `segment_indexes`): the same records, attempts, backoff and Failed state
as in `vchan datacoord`, so `vchan tasks` and `vchan describe-index` read the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.tasks import (
    DEFERRED,
    DONE,
    Outcome,
    RoundReport,
    TaskScheduler,
    TaskSpec,
    enqueue_tasks,
    failed,
    held_tasks,
    list_tasks,
    queue_once,
    retry_tasks,
)
from vchan_assets.indexes.engine import OURS, build_engine, target_engine
from vchan_assets.indexes.meta import (
    create_missing_builds,
    list_builds,
    list_indexes,
    reissue_build,
    release_waiting_outputs,
    reset_segment_builds,
)
from vchan_assets.indexes.step import IndexBuilder, IndexReport
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import (
    SPARSE_ROW_BYTES,
    CollectionInfo,
    FieldSchema,
    IndexEngine,
    SegmentIndex,
    SegmentIndexState,
    SegmentInfo,
    TaskRecord,
    TaskState,
)
from vchan_assets.spark import Engine
from vchan_assets.system import System

KIND = "index"
# What a build holds in memory, over the raw vectors it indexes (the vectors, the
# normalized copy, the index).
BUILD_MEMORY_FACTOR = 3.0


def build_memory_mb(rows: int, dim: int) -> float:
    return BUILD_MEMORY_FACTOR * rows * dim * 4 / 2**20


def memory_dim(field: FieldSchema) -> int:
    """The float32 values a row of the field holds, for memory estimates: its dim, or a
    sparse row's estimated size (`SPARSE_ROW_BYTES`) in 4-byte values."""
    return SPARSE_ROW_BYTES // 4 if field.is_sparse else field.dim or 0


class IndexTasks:
    """`versions`: the index engine versions the builds can write (`indexes.engine`);
    `on_report`: told each batch's `IndexReport` (what a Dagster run reports)."""

    name = KIND
    follows: str | None = "sort"
    versions: IndexEngine = OURS
    on_report: Callable[[IndexReport], None] | None = None

    def __init__(
        self, versions: IndexEngine = OURS, on_report: Callable[[IndexReport], None] | None = None
    ) -> None:
        self.versions = versions
        self.on_report = on_report

    def discover(self, system: System, collections: Collection[int] | None) -> list[TaskSpec]:
        """Builds for the indexable segments without one, then a task for each segment
        with an Unissued or Failed build of a live index. Also releases the compaction
        outputs that waited for a build Failed for good (its task Failed) or too long
        (`release_waiting_outputs`)."""
        store = system.store
        tasks = [d.model for d in list_tasks(store, KIND)]
        specs: dict[int, TaskSpec] = {}
        for info in CollectionRegistry(store).list():
            if collections is not None and info.id not in collections:
                continue
            indexes = {d.model.index_id: d.model for d in list_indexes(store, info.id)}
            if not indexes:
                continue
            create_missing_builds(store, info, list(indexes.values()))
            active = {
                t.segment_id for t in tasks if t.collection_id == info.id and t.state is not TaskState.FAILED
            }
            release_waiting_outputs(store, info.id, system.settings.index_handoff_timeout, active)
            dims = {f.field_id: memory_dim(f) for f in info.schema.vector_fields}
            for d in list_builds(store, info.id):
                b = d.model
                index = indexes.get(b.index_id)
                if index is None or b.state not in (SegmentIndexState.UNISSUED, SegmentIndexState.FAILED):
                    continue
                mb = build_memory_mb(b.rows, dims.get(index.field_id, 0))
                if (known := specs.get(b.segment_id)) is not None:
                    mb += known.memory_mb
                specs[b.segment_id] = TaskSpec(b.collection_id, b.partition_id, b.segment_id, b.rows, mb)
        return list(specs.values())

    def run(self, system: System, engine: Engine, tasks: Sequence[TaskRecord]) -> dict[int, Outcome]:
        """Every build of the tasks' segments that is not Finished, as one job."""
        store = system.store
        segments = {t.segment_id for t in tasks}
        live = {d.model.index_id for d in list_indexes(store)}
        builds = [
            d.model
            for c in {t.collection_id for t in tasks}
            for d in list_builds(store, c)
            if d.model.segment_id in segments and d.model.index_id in live
        ]
        todo = {b.build_id for b in builds if b.state is not SegmentIndexState.FINISHED}
        report = IndexBuilder(system, engine, versions=self.versions).run(build_ids=todo, restart=True)
        if self.on_report is not None:
            self.on_report(report)
        reasons, lost = dict(report.failed), set(report.lost)
        result: dict[int, Outcome] = {}
        for t in tasks:
            mine = [b for b in builds if b.segment_id == t.segment_id and b.build_id in todo]
            failures = [reasons[b.build_id] for b in mine if b.build_id in reasons]
            if failures:
                result[t.segment_id] = failed("; ".join(failures))
            elif any(b.build_id in lost for b in mine):
                result[t.segment_id] = DEFERRED  # changed by another builder meanwhile
            else:  # finished, or not started: its segment is gone or Dropped, its index dropped
                result[t.segment_id] = DONE
        return result


@dataclass
class BuildRound:
    """What one vchannel's builds through the task scheduler did: the builds created (of
    the whole collection, as CreateIndex's), the builds run, the rounds' report, and the
    vchannel's index tasks held back after it (Failed, or backing off)."""

    created: list[int] = field(default_factory=list)
    builds: IndexReport = field(default_factory=IndexReport)
    report: RoundReport = field(default_factory=RoundReport)
    held: list[TaskRecord] = field(default_factory=list)


def build_vchannel(
    system: System, engine: Engine, info: CollectionInfo, segments: Collection[int]
) -> BuildRound:
    """The index builds of `segments` (one vchannel's indexable segments) through the
    DataCoord's task scheduler, from a process that is one of several (a Dagster run: not
    `exclusive`): the builds the collection's sorted segments lack, an index task queued for
    each of `segments` with a build to run (`IndexTasks.discover`), then rounds of those
    tasks only. A task backing off or Failed is not run before its time."""
    store = system.store
    found = BuildRound(created=[b.build_id for b in create_missing_builds(store, info)])
    reports: list[IndexReport] = []
    kind = IndexTasks(on_report=reports.append)
    scheduler = TaskScheduler([kind], system.settings, exclusive=False)
    wanted = set(segments)
    scheduler.enqueue(store, KIND, [s for s in kind.discover(system, {info.id}) if s.segment_id in wanted])
    found.report = scheduler.run_now(system, engine, wanted)
    for report in reports:
        found.builds.merge(report)
    found.held = held_tasks(store, KIND, wanted, time.time())
    return found


def retry_failed_builds(store: MetaStore, collection_id: int | None = None) -> tuple[int, int]:
    """Failed builds (of one collection if given) back to Unissued, and Failed index tasks
    back to the queue. Returns (builds, tasks) re-queued."""
    failed_builds = [
        d for d in list_builds(store, collection_id) if d.model.state is SegmentIndexState.FAILED
    ]
    builds = sum(reissue_build(store, d) is not None for d in failed_builds)
    return builds, len(retry_tasks(store, KIND, collection_id))


def _rebuild(
    store: MetaStore, builds: list[Decoded[SegmentIndex]], dim: int, reason: str
) -> list[SegmentIndex]:
    """Each build back to Unissued (those that did not change meanwhile) and a task queued
    for each of their segments that has none. Returns the builds re-issued."""
    again = [found.model for d in builds if (found := reissue_build(store, d, reason)) is not None]
    specs = {
        b.segment_id: TaskSpec(
            b.collection_id, b.partition_id, b.segment_id, b.rows, build_memory_mb(b.rows, dim)
        )
        for b in again
    }
    enqueue_tasks(store, KIND, specs.values())
    return again


def queue_rebuild(store: MetaStore, build: Decoded[SegmentIndex], dim: int) -> bool:
    """A Finished build whose file a reader found missing or unreadable: rebuilt by the
    DataCoord's next round. False if it changed meanwhile (another reader re-issued it)."""
    if build.model.state is not SegmentIndexState.FINISHED:
        return False
    return bool(_rebuild(store, [build], dim, "its index file was found missing or unreadable"))


def upgrade_builds(
    store: MetaStore, collection_id: int | None = None, builder: IndexEngine = OURS
) -> tuple[int, list[SegmentIndex]]:
    """`vchan index --upgrade`: the Finished builds with files (of one collection if given)
    of an older engine version than builds write now, re-issued and their tasks queued.
    Returns (the version builds write, the builds re-issued)."""
    target = target_engine(store, builder)
    again: list[SegmentIndex] = []
    for info in CollectionRegistry(store).list():
        if collection_id not in (None, info.id):
            continue
        dims = {f.field_id: memory_dim(f) for f in info.schema.vector_fields}
        for index in list_indexes(store, info.id):
            older = [
                d
                for d in list_builds(store, info.id)
                if d.model.index_id == index.model.index_id
                and d.model.state is SegmentIndexState.FINISHED
                and d.model.files
                and build_engine(d.model) < target
            ]
            reason = f"upgraded to index engine version {target}"
            again += _rebuild(store, older, dims.get(index.model.field_id, 0), reason)
    return target, again


def rebuild_segment(system: System, seg: SegmentInfo, reason: str) -> list[SegmentIndex]:
    """`seg`'s rows changed under its index builds (`lifecycle.quarantine`: a damaged binlog
    taken out): every build of it reset (`reset_segment_builds`: Unissued with `reason`, or
    Finished without files when the rows left need none), and the segment's index task
    queued once (a Failed one re-queued: its damaged file may be what it failed on), so the
    DataCoord builds over the rows the segment holds now and a search meanwhile searches
    it exactly. Returns the builds as written."""
    store = system.store
    builds = reset_segment_builds(store, seg, reason)
    if builds:
        info = CollectionRegistry(store).get(seg.collection_id, include_dropped=True)
        dims = {f.field_id: memory_dim(f) for f in info.schema.vector_fields}
        fields = {d.model.index_id: d.model.field_id for d in list_indexes(store, seg.collection_id)}
        mb = sum(
            build_memory_mb(b.rows, dims.get(fields.get(b.index_id, -1), 0))
            for b in builds
            if b.state is SegmentIndexState.UNISSUED
        )
        # Queued even with nothing left to build: its run finds nothing and deletes it (a
        # Failed task of the damaged segment would otherwise stay Failed).
        queue_once(store, KIND, TaskSpec.of(seg, mb))
    return builds
