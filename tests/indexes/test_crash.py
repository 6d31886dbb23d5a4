"""Crash safety of index builds, with a real `vchan datacoord` process and real etcd:

- a Spark Python worker SIGKILLed mid-build (its index file written, the outcome not
  returned; the scheduler runs in this process, the driver): the Spark job fails, the
  build is Failed naming no file (searched exactly meanwhile), the task is retried after
  its backoff under a new version, and GC deletes the killed attempt's file;
- DropIndex while a build waits to commit: the commit is refused, nothing of the index
  comes back, GC removes its builds and files;
- the segments compacted away while their builds wait to commit: the builds still commit
  (the inputs are served, through them, until their output is indexed), the output gets
  its own build, replaces its inputs once built, and GC then removes the inputs' builds;
- the DataCoord SIGKILLed with builds in flight (their files written, not committed): its
  tasks stay in etcd, and the next DataCoord (restarted, or the standby that takes over)
  builds them again under a new version."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.tasks import TaskScheduler, list_tasks
from vchan_assets.failpoints import ENV as FAILPOINT_ENV
from vchan_assets.failpoints import MARKER_ENV as FAILPOINT_MARKER_ENV
from vchan_assets.indexes.build import load_index
from vchan_assets.indexes.gc import collect_indexes
from vchan_assets.indexes.meta import create_index, drop_index, list_indexes
from vchan_assets.indexes.tasks import IndexTasks
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector, GcReport
from vchan_assets.lifecycle.plans import CompactionType
from vchan_assets.model import SegmentIndexState, TaskState
from vchan_assets.query.view import collection_views
from vchan_assets.spark.session import get_spark
from vchan_assets.storage.layout import INDEX_FILES
from vchan_assets.system import System
from vchan_assets.testing.index_data import (
    PATIENCE,
    Clock,
    Data,
    builds,
    datacoord,
    flushed_segments,
    live_sorted,
    new_data,
    sorted_segments,
    wait_for,
)
from vchan_assets.wal.producer import Producer

QUERY = np.random.default_rng(5).normal(0.0, 4.0, (3, 16)).astype(np.float32)


def gc(system: System) -> GcReport:
    return GarbageCollector(system, clock=lambda: time.time() + 2 * 86400, passes=[collect_indexes]).run()


def index_files(system: System) -> list[str]:
    return sorted(system.storage.key_of(f.path) for f in system.storage.list_files(INDEX_FILES + "/"))


@contextmanager
def frozen_at_commit(system: System, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A DataCoord stopped (SIGSTOP) at its first build's commit: files written, not
    Finished (failpoint `index_after_files=stop-once`); SIGCONT lets it go on."""
    marker = tmp_path / "failpoint"
    env = {"VCHAN_FAILPOINT": "index_after_files=stop-once", "VCHAN_FAILPOINT_MARKER": str(marker)}
    with datacoord(system, **env) as process:
        wait_for(
            process,
            lambda: marker.exists() and len(marker.read_text().split()) == 2,
            "a build stopped at its commit",
        )
        assert int(marker.read_text().split()[1]) == process.pid
        yield process


def indexed_collection(system: System, producer: Producer, sort: bool = True) -> Data:
    """Two segments of 1,500 and 1,300 rows (sorted, or only flushed) and an IVF_FLAT index."""
    data = new_data(producer)
    (sorted_segments if sort else flushed_segments)(system, producer, data, [1500, 1300])
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    return data


def all_done(system: System, data: Data) -> Callable[[], bool]:
    def done() -> bool:
        states = {b.state for b in builds(system, data)}
        return states == {SegmentIndexState.FINISHED} and not list_tasks(system.store)

    return done


def test_a_spark_worker_killed_mid_build_is_retried_and_no_half_index_is_ever_visible(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    data = new_data(producer)
    sorted_segments(system, producer, data, [1500])
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    marker = tmp_path / "failpoint"
    spark = get_spark(system.settings)
    clock = Clock()
    sched = TaskScheduler([IndexTasks()], replace(system.settings, task_retry_backoff=5.0), clock)
    sched.scan(system)
    # Armed in the Spark Python workers of this job only (as `spark.executorEnv.*` does on a
    # cluster): the first to finish writing its index file SIGKILLs itself there.
    armed = {FAILPOINT_ENV: "index_built=kill-once", FAILPOINT_MARKER_ENV: str(marker)}
    spark.sparkContext.environment.update(armed)
    try:
        first = sched.round(system.with_spark(spark), "spark")
    finally:
        for name in armed:
            spark.sparkContext.environment.pop(name, None)

    assert marker.read_text().split()[0] == "index_built"
    assert int(marker.read_text().split()[1]) != os.getpid(), "a Python worker died, not the driver"
    [(_, _, reason)] = first.retried
    assert "Spark job failed" in reason
    [task] = [d.model for d in list_tasks(system.store)]
    assert task.attempts == 1 and task.reason == reason and task.not_before == clock.now + 5.0
    [build] = builds(system, data)
    assert build.state is SegmentIndexState.FAILED and build.version == 1 and build.files == ()
    killed_file = f"{INDEX_FILES}/{build.build_id}/1/index.faiss"
    assert system.storage.exists(killed_file), "written whole, never named by its build"
    exact = Catalog(system).search(data.info.name, QUERY, k=5)  # the segment is searched exactly

    clock.now += 6.0
    second = sched.round(system.with_spark(spark), "spark")

    assert second.done == [("index", build.segment_id)] and not list_tasks(system.store)
    [build] = builds(system, data)
    assert build.state is SegmentIndexState.FINISHED and build.version == 2
    assert build.files == (f"{INDEX_FILES}/{build.build_id}/2/index.faiss",)
    assert load_index(system.storage.read_bytes(build.files[0])).ntotal == 1500
    through_index = Catalog(system).search(data.info.name, QUERY, k=5)
    assert list(through_index["pk"]) == list(exact["pk"])
    # The killed worker's file is superseded: GC deletes it.
    assert gc(system).index_files == [killed_file]
    assert index_files(system) == [build.files[0]]


def test_a_datacoord_killed_with_builds_in_flight_leaves_them_to_the_next_one(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    data = indexed_collection(system, producer, sort=False)
    marker = tmp_path / "failpoint"
    with datacoord(
        system, VCHAN_FAILPOINT="index_after_files=kill", VCHAN_FAILPOINT_MARKER=str(marker)
    ) as first:
        assert first.wait(PATIENCE) == -signal.SIGKILL, "killed with its builds' files written, not committed"
    assert marker.read_text().startswith("index_after_files")
    killed = builds(system, data)
    assert len(killed) == 2 and {b.state for b in killed} == {SegmentIndexState.IN_PROGRESS}
    in_flight = [d.model for d in list_tasks(system.store, "index")]
    assert len(in_flight) == 2 and {t.state for t in in_flight} == {TaskState.IN_PROGRESS}
    assert not list_tasks(system.store, "sort"), "the sorts were done before the builds"

    with datacoord(system) as second:
        wait_for(second, all_done(system, data), "finished by the second DataCoord")
    done = builds(system, data)
    assert [b.version for b in done] == [2, 2], "started again by the second DataCoord"
    assert all(b.files and system.storage.exists(b.files[0]) for b in done)

    # The killed builder's files (version 1) are superseded: index GC deletes them.
    old = [f"{INDEX_FILES}/{b.build_id}/1/index.faiss" for b in done]
    assert all(system.storage.exists(k) for k in old)
    report = gc(system)
    assert sorted(report.index_files) == sorted(old) and not report.index_builds
    assert all(system.storage.exists(b.files[0]) for b in done)


def test_the_standby_finishes_the_builds_of_a_datacoord_that_froze_with_them_in_flight(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    data = indexed_collection(system, producer)
    with frozen_at_commit(system, tmp_path) as first:
        # What the frozen one had started (its first round took both builds, or one when
        # the task budget left on a loaded machine admitted one: then the other is not
        # in flight, and the standby builds it first, at version 1)
        frozen = {
            b.build_id: b.version for b in builds(system, data) if b.state is SegmentIndexState.IN_PROGRESS
        }
        assert frozen, "no build in flight at the frozen commit"
        with datacoord(system) as standby:
            # The frozen one's session lease lapses; the standby wins the election, takes its
            # tasks (their worker's term ended) and builds them again under a new version.
            wait_for(standby, all_done(system, data), "finished by the standby")
        first.kill()  # never resumed: its commit never happens
        first.wait()
    done = {b.build_id: b for b in builds(system, data)}
    assert all(done[i].version == v + 1 for i, v in frozen.items()), "built again under a new version"
    assert len(done) == 2 and all(system.storage.exists(b.files[0]) for b in done.values())


def test_drop_index_during_a_build_is_not_undone_by_its_commit_and_gc_removes_its_files(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    data = indexed_collection(system, producer)

    with frozen_at_commit(system, tmp_path) as process:
        assert len(index_files(system)) == 2, "both files written, neither build committed"
        drop_index(system.store, data.info, field="vec")
        os.kill(process.pid, signal.SIGCONT)
        wait_for(process, lambda: not list_tasks(system.store), "done with the dropped index's tasks")

    assert SegmentIndexState.FINISHED not in {b.state for b in builds(system, data)}, "no commit"
    [index] = list_indexes(system.store, data.info.id, include_deleted=True)
    assert index.model.deleted, "still dropped"
    report = gc(system)
    assert len(report.index_files) == 2 and len(report.index_builds) == 2
    assert index_files(system) == [] and builds(system, data) == []
    gc(system)
    assert list_indexes(system.store, data.info.id, include_deleted=True) == []


def test_segments_compacted_away_during_their_builds_hand_over_to_the_output_once_it_is_built(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    data = indexed_collection(system, producer)
    parents = {s.id for s in live_sorted(system, data.info)}

    with frozen_at_commit(system, tmp_path) as process:
        info = CollectionRegistry(system.store).get(data.info.id)
        [plan] = CompactionTrigger(system).trigger(info, CompactionType.MIX, manual=True)
        CompactionExecutor(system, "local").run_pending([plan.plan_id])
        [child] = live_sorted(system, data.info)
        assert set(child.compaction_from) == parents
        os.kill(process.pid, signal.SIGCONT)
        wait_for(process, lambda: len(builds(system, data)) == 3 and all_done(system, data)(), "built")

    by_segment = {b.segment_id: b for b in builds(system, data)}
    assert set(by_segment) == parents | {child.id}, "the output got its own build"
    [child] = live_sorted(system, data.info)
    assert child.ready_ts, "its build's commit made it ready"
    views = collection_views(system.store, CollectionRegistry(system.store).get(data.info.id))
    assert {s.id for v in views for s in v.flushed} == {child.id}

    report = gc(system)
    assert parents <= set(report.dropped_segments)
    assert sorted(report.index_builds) == sorted(by_segment[p].build_id for p in parents)
    assert index_files(system) == list(by_segment[child.id].files)
