"""Index garbage collection, a pass of the GC: builds of a dropped index, builds of a
segment gone (once the compaction output made from it is indexed), files of superseded
versions and of unknown builds; never a live build's files."""

from __future__ import annotations

import time

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.tasks import TaskScheduler
from vchan_assets.indexes.gc import collect_indexes
from vchan_assets.indexes.meta import drop_index, list_builds, list_indexes
from vchan_assets.indexes.tasks import IndexTasks
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector, GcReport
from vchan_assets.lifecycle.plans import CompactionType
from vchan_assets.model import SegmentIndex, SegmentIndexState
from vchan_assets.storage.layout import index_file_key
from vchan_assets.system import System
from vchan_assets.testing.index_data import Data, ivf_indexed, live_sorted
from vchan_assets.wal.producer import Producer

LATER = 2 * 86400  # past every tolerance of the defaults


def gc(system: System, ahead: float = LATER) -> GcReport:
    return GarbageCollector(system, clock=lambda: time.time() + ahead, passes=[collect_indexes]).run()


def builds(system: System, data: Data) -> list[SegmentIndex]:
    return [d.model for d in list_builds(system.store, data.info.id)]


def test_a_dropped_index_loses_its_builds_and_files_then_its_record(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500, 1300], build=True)
    files = [f for b in builds(system, data) for f in b.files]
    assert len(files) == 2 and all(system.storage.exists(f) for f in files)
    drop_index(system.store, data.info, field="vec")

    first = gc(system, ahead=0)  # no tolerance applies to a dropped index's builds

    assert sorted(first.index_files) == sorted(files) and len(first.index_builds) == 2
    assert not builds(system, data) and not any(system.storage.exists(f) for f in files)
    gc(system, ahead=0)
    assert not list_indexes(system.store, data.info.id, include_deleted=True)


def test_a_compacted_segments_builds_wait_for_the_outputs_index_then_go(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500, 1300], build=True)
    parents = {b.build_id: b for b in builds(system, data)}
    info = CollectionRegistry(system.store).get(data.info.id)
    [plan] = CompactionTrigger(system).trigger(info, CompactionType.MIX, manual=True)
    CompactionExecutor(system, "local").run_pending([plan.plan_id])
    [child] = live_sorted(system, data.info)
    assert set(child.compaction_from) == {b.segment_id for b in parents.values()}

    waiting = gc(system)  # the inputs' meta and builds wait for the output's index

    assert not set(waiting.dropped_segments) & set(child.compaction_from)
    assert not waiting.index_builds and not waiting.index_files
    assert all(system.storage.exists(b.files[0]) for b in parents.values())

    sched = TaskScheduler([IndexTasks()], system.settings)
    sched.scan(system)
    sched.round(system, "local")
    [built] = [b for b in builds(system, data) if b.segment_id == child.id]
    assert built.state is SegmentIndexState.FINISHED

    collected = gc(system)  # the inputs' meta, then their builds

    assert set(collected.dropped_segments) >= set(child.compaction_from)
    assert sorted(collected.index_builds) == sorted(parents)
    assert not any(system.storage.exists(b.files[0]) for b in parents.values())
    assert [b.segment_id for b in builds(system, data)] == [child.id]
    assert system.storage.exists(built.files[0])


def test_files_of_unknown_builds_and_superseded_versions_go_after_the_tolerance(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500], build=True)
    [build] = builds(system, data)
    unknown = index_file_key(987654321, 1, "index.faiss")
    superseded = index_file_key(build.build_id, build.version + 5, "index.faiss")
    for key in (unknown, superseded):
        system.storage.write_atomic(key, b"not an index")

    young = gc(system, ahead=0)
    assert not young.index_files, "a build in flight writes its files before its commit"

    old = gc(system)

    assert sorted(old.index_files) == sorted([unknown, superseded]) and not old.index_builds
    assert not system.storage.exists(unknown) and not system.storage.exists(superseded)
    assert system.storage.exists(build.files[0]) and builds(system, data) == [build]
