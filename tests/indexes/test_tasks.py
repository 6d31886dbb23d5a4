"""The DataCoord's one task scheduler with its two kinds, sort and index builds: sorts run
before the builds they push, a segment is queued once per kind, a failing build is
retried a bounded number of times, each after a doubling backoff, then Failed (and shown
by `vchan status`) until `vchan index --retry`, admission by memory, and a dead worker's
task back in the queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
from rich.console import Console

from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.tasks import Outcome, RoundReport, TaskScheduler, TaskSpec, list_tasks
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.tasks import IndexTasks
from vchan_assets.lifecycle.sort_tasks import SortTasks
from vchan_assets.meta.store import Decoded
from vchan_assets.model import SegmentIndexState, SegmentInfo, SegmentState, TaskRecord, TaskState
from vchan_assets.spark import Engine
from vchan_assets.status import collect_status, render_status
from vchan_assets.system import System
from vchan_assets.testing.index_data import (
    Clock,
    Data,
    flushed_segments,
    ivf_indexed,
    live_sorted,
    sorted_segments,
    vectors_lost,
)
from vchan_assets.testing.steps import run_vchan
from vchan_assets.wal.producer import Producer


def scheduler(system: System, clock: Clock | None = None, backoff: float = 0.0) -> TaskScheduler:
    """The DataCoord's scheduler; failed attempts retried in the next round unless `backoff`."""
    settings = replace(system.settings, task_retry_backoff=backoff)
    return TaskScheduler([SortTasks(), IndexTasks()], settings, clock or time.time)


def states(system: System, data: Data) -> list[SegmentIndexState]:
    return [d.model.state for d in list_builds(system.store, data.info.id)]


def list_segments(system: System, data: Data) -> list[Decoded[SegmentInfo]]:
    return system.store.list_models(system.store.keys.segment.under(data.info.id), SegmentInfo)[0]


def tasks(system: System) -> dict[tuple[str, int], TaskRecord]:
    return {(d.model.kind, d.model.segment_id): d.model for d in list_tasks(system.store)}


def test_a_round_runs_the_sorts_first_then_the_builds_their_commit_pushed(
    system: System, producer: Producer, data: Data
) -> None:
    flushed_segments(system, producer, data, [1500, 1300])
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    sched = scheduler(system)

    queued = sched.scan(system)
    assert [kind for kind, _ in queued] == ["sort", "sort"], "unsorted segments get no build yet"
    report = sched.round(system, "local")

    kinds = [kind for kind, _ in report.ran]
    assert kinds == ["sort", "sort", "index", "index"], report.ran
    sorted_ids = {s.id for s in live_sorted(system, data.info)}
    assert {seg for kind, seg in report.ran if kind == "index"} == sorted_ids
    assert states(system, data) == [SegmentIndexState.FINISHED] * 2
    assert tasks(system) == {}, "done tasks are deleted"


def test_a_sort_queued_after_index_builds_runs_before_them(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500])
    sched = scheduler(system)
    assert [kind for kind, _ in sched.scan(system)] == ["index"]
    flushed_segments(system, producer, data, [1300])
    assert [kind for kind, _ in sched.scan(system)] == ["sort"]

    report = sched.round(system, "local")

    assert [kind for kind, _ in report.ran] == ["sort", "index", "index"], report.ran
    assert states(system, data) == [SegmentIndexState.FINISHED] * 2


def test_a_segment_is_queued_once_per_kind(system: System, producer: Producer, data: Data) -> None:
    sorted_segments(system, producer, data, [1500])
    create_index(system.store, data.info, "vec", "HNSW", "L2", {"M": 8, "efConstruction": 40})
    sched = scheduler(system)
    [seg] = live_sorted(system, data.info)

    assert sched.scan(system) == [("index", seg.id)]
    assert sched.scan(system) == []
    spec = TaskSpec.of(seg, 1.0)
    assert sched.enqueue(system.store, "index", [spec, spec]) == []
    assert sched.enqueue(system.store, "sort", [spec]) == [seg.id], "another kind is another task"
    assert len(list_tasks(system.store)) == 2


def test_a_failing_build_is_retried_after_a_doubling_backoff_up_to_the_limit_then_failed_shown_and_retried_on_request(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500])
    [seg] = live_sorted(system, data.info)
    saved = vectors_lost(system, data, seg)
    clock = Clock()
    sched = scheduler(system, clock, backoff=30.0)
    sched.scan(system)

    rounds = [sched.round(system, "local")]
    task = tasks(system)[("index", seg.id)]
    assert "vectors unreadable" in task.reason and task.state is TaskState.QUEUED
    assert task.not_before == pytest.approx(clock.now + 30.0), "30 s after the first failure"
    clock.now += 29.0
    waited = sched.round(system, "local")
    assert waited.ran == [] and waited.backing_off == 1, "not run again before its backoff"
    clock.now += 2.0
    rounds.append(sched.round(system, "local"))
    assert tasks(system)[("index", seg.id)].not_before == pytest.approx(clock.now + 60.0), "doubled"
    clock.now += 61.0
    rounds.append(sched.round(system, "local"))

    assert [len(r.ran) for r in rounds] == [1, 1, 1]
    assert [len(r.retried) for r in rounds] == [1, 1, 0]
    assert [len(r.failed) for r in rounds] == [0, 0, 1]
    task = tasks(system)[("index", seg.id)]
    assert task.state is TaskState.FAILED and task.attempts == 3
    assert "vectors unreadable" in task.reason
    assert sched.round(system, "local").ran == [], "a Failed task is not run again"
    assert sched.scan(system) == [], "nor queued again"
    status = collect_status(Catalog(system), orphans=False)
    [warning] = [w for w in status["warnings"] if w["kind"] == "task_failed"]
    assert f"index task of segment {seg.id}" in warning["message"] and "--retry" in warning["message"]
    [row] = status["tasks"]
    assert (row["kind"], row["segment"], row["state"], row["attempts"]) == ("index", seg.id, "Failed", 3)
    shown = Console(width=200, record=True)
    shown.print(render_status(status))
    assert "sort and index tasks" in shown.export_text()

    for path, blob in saved.items():
        system.storage.write_atomic(path, blob)
    done = run_vchan(system.settings, "index", "--retry", "--collection", data.info.name)
    assert done.returncode == 0, done.stderr
    assert "re-queued 1 failed index builds" in done.stdout
    assert tasks(system)[("index", seg.id)].attempts == 0
    assert tasks(system)[("index", seg.id)].not_before == 0.0
    assert states(system, data) == [SegmentIndexState.UNISSUED]
    assert sched.round(system, "local").done == [("index", seg.id)]
    assert states(system, data) == [SegmentIndexState.FINISHED]


def test_a_sort_that_fails_is_retried_up_to_the_limit_then_failed(
    system: System, producer: Producer, data: Data
) -> None:
    flushed_segments(system, producer, data, [1500])
    sched = scheduler(system)
    [(_, seg_id)] = sched.scan(system)
    [d] = [d for d in list_segments(system, data) if d.model.id == seg_id]
    system.storage.delete(d.model.binlog_files[0].path)

    rounds = [sched.round(system, "local") for _ in range(3)]

    assert [(len(r.retried), len(r.failed)) for r in rounds] == [(1, 0), (1, 0), (0, 1)]
    task = tasks(system)[("sort", seg_id)]
    assert task.state is TaskState.FAILED and task.attempts == 3 and task.reason

    [d] = [d for d in list_segments(system, data) if d.model.id == seg_id]
    system.store.cas(d.kv.key, d.kv.version, replace(d.model, state=SegmentState.DROPPED))  # as a compaction
    assert sched.scan(system) == [] and tasks(system) == {}, "the full scan prunes its task"


def test_a_failed_task_is_tried_again_on_its_own_after_a_doubling_wait_and_at_once_by_vchan_tasks(
    system: System, producer: Producer, data: Data
) -> None:
    """Failed is never for good: VCHAN_TASK_FAILED_RETRY after it ended Failed the task is
    back in the queue with its attempts reset (twice as long after the next time), and
    `vchan tasks --retry` re-queues it at once; `vchan tasks` lists it with its reason."""
    flushed_segments(system, producer, data, [1500])
    clock = Clock()
    settings = replace(system.settings, task_failed_retry=100.0, task_retry_backoff=0.0)
    sched = TaskScheduler([SortTasks()], settings, clock)
    [(_, seg_id)] = sched.scan(system)
    [d] = [d for d in list_segments(system, data) if d.model.id == seg_id]
    path = d.model.binlog_files[0].path
    saved = system.storage.read_bytes(path)
    system.storage.delete(path)

    def fail_out() -> TaskRecord:
        for _ in range(3):
            sched.round(system, "local")
        return tasks(system)[("sort", seg_id)]

    first = fail_out()
    assert first.state is TaskState.FAILED and first.failures == 1
    assert first.not_before == pytest.approx(clock.now + 100.0)
    clock.now += 99.0
    assert sched.round(system, "local").revived == [], "not before its time"
    clock.now += 2.0
    assert sched.round(system, "local").revived == [("sort", seg_id)]
    second = fail_out()  # its attempts were reset: three more, then Failed again
    assert second.state is TaskState.FAILED and second.failures == 2
    assert second.not_before == pytest.approx(clock.now + 200.0), "doubled"

    listed = run_vchan(system.settings, "tasks", "--kind", "sort")
    assert listed.returncode == 0, listed.stderr
    assert f"sort of segment {seg_id} (collection {data.info.id}): Failed, attempts 3" in listed.stdout
    system.storage.write_atomic(path, saved)
    again = run_vchan(system.settings, "tasks", "--retry", "--collection", data.info.name)
    assert again.returncode == 0, again.stderr
    assert "re-queued 1 failed sort tasks and 0 failed index tasks" in again.stdout
    assert sched.round(system, "local").done == [("sort", seg_id)]


def test_admission_by_memory_runs_one_task_over_the_budget_alone(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500, 1400])
    tight = replace(system.settings, task_memory_mb=0.1)  # a build of 1,500 16-d vectors: ~0.27 MB
    sched = TaskScheduler([SortTasks(), IndexTasks()], tight)
    sched.scan(system)

    first = sched.round(system, "local")
    second = sched.round(system, "local")

    assert len(first.ran) == 1 and first.waiting == 1
    assert len(second.ran) == 1 and second.waiting == 0
    assert states(system, data) == [SegmentIndexState.FINISHED] * 2


def test_a_task_of_a_dead_worker_goes_back_to_the_queue_and_is_finished(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500])
    [seg] = live_sorted(system, data.info)
    sched = scheduler(system)
    sched.scan(system)
    [d] = list_tasks(system.store)
    dead = replace(
        d.model, state=TaskState.IN_PROGRESS, attempts=1, worker="elsewhere:1@7", started_at=time.time()
    )
    system.store.cas(d.kv.key, d.kv.version, dead)

    report = sched.round(system, "local")

    assert report.recovered == [("index", seg.id)]
    assert report.done == [("index", seg.id)]
    assert states(system, data) == [SegmentIndexState.FINISHED]


def _dies_under(sched: TaskScheduler, system: System, key: tuple[str, int]) -> TaskRecord:
    """The task starts (an attempt) under a worker that dies, and the next round finds it."""
    [d] = [d for d in list_tasks(system.store) if (d.model.kind, d.model.segment_id) == key]
    running = replace(
        d.model,
        state=TaskState.IN_PROGRESS,
        attempts=d.model.attempts + 1,
        worker="elsewhere:1@7",
        started_at=time.time(),
    )
    system.store.cas(d.kv.key, d.kv.version, running)
    report = RoundReport()
    sched.recover(system.store, report)
    assert report.recovered == [key]
    return tasks(system)[key]


def test_a_worker_dying_under_a_task_spends_attempts_only_from_its_second_death_in_a_row(
    system: System, producer: Producer, data: Data
) -> None:
    """A DataCoord killed three times for its own reasons while a sort ran: the sort still
    finishes (the first death spent no attempt; after it the task runs alone). A task that
    kills its worker every time is Failed at its fourth death (VCHAN_TASK_MAX_ATTEMPTS 3)."""
    flushed_segments(system, producer, data, [1500, 1400])
    sched = TaskScheduler([SortTasks()], system.settings)
    unlucky, poison = (("sort", seg) for _, seg in sorted(sched.scan(system)))

    seen = [_dies_under(sched, system, unlucky) for _ in range(3)]
    assert [(t.attempts, t.deaths, t.state) for t in seen] == [
        (0, 1, TaskState.QUEUED),
        (1, 2, TaskState.QUEUED),
        (2, 3, TaskState.QUEUED),
    ]
    alone = sched.round(system, "local")
    assert alone.ran == [unlucky] and alone.done == [unlucky], "a suspect runs in a batch of its own"

    deaths = [_dies_under(sched, system, poison) for _ in range(4)]
    assert [t.state for t in deaths] == [TaskState.QUEUED] * 3 + [TaskState.FAILED]
    assert deaths[-1].attempts == 3 and "died or its term ended" in deaths[-1].reason


class GatedIndexTasks(IndexTasks):
    """The real index kind, whose batches wait for `gate` before they build: a build that
    takes minutes, on demand."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def run(self, system: System, engine: Engine, tasks: Sequence[TaskRecord]) -> dict[int, Outcome]:
        assert self.gate.wait(60), "the test never opened the gate"
        return super().run(system, engine, tasks)


def rounds_until(sched: TaskScheduler, system: System, done: Callable[[RoundReport], bool]) -> RoundReport:
    total = RoundReport()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        report = sched.round(system, "local", wait=False)
        total.ran += report.ran
        total.done += report.done
        if done(total):
            return total
        time.sleep(0.1)
    raise AssertionError(f"rounds never got there: {total}")


def test_a_sort_runs_and_is_recorded_while_an_index_batch_is_still_building(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500, 1400])
    index = GatedIndexTasks()
    sched = TaskScheduler([SortTasks(), index], replace(system.settings, task_slots=2))
    sched.scan(system)

    first = sched.round(system, "local", wait=False)
    assert [kind for kind, _ in first.ran] == ["index"], "index builds hold at most half the slots"
    assert first.waiting == 1 and sched.busy == ["index"]
    flushed_segments(system, producer, data, [1300])
    sched.scan(system, kinds=["sort"])

    report = rounds_until(sched, system, lambda r: any(kind == "sort" for kind, _ in r.done))
    assert sched.busy == ["index"], "the sort did not wait for the index batch"
    assert not any(kind == "index" for kind, _ in report.done)
    assert len(live_sorted(system, data.info)) == 3

    index.gate.set()
    rounds_until(sched, system, lambda r: not sched.busy and not list_tasks(system.store))
    assert states(system, data) == [SegmentIndexState.FINISHED] * 3, "the sort's push queued its build"


def test_a_round_after_a_stop_abandoned_the_batch_in_flight_starts_nothing_again(
    system: System, producer: Producer, data: Data
) -> None:
    """A stopping DataCoord gives its batch up (back in the queue, for the next DataCoord);
    its task loop may still be mid-round in another thread: that round must not admit the
    tasks just given back under the ending term (they would stay InProgress once it ends)."""
    ivf_indexed(system, producer, data, [1500])
    index = GatedIndexTasks()
    sched = TaskScheduler([SortTasks(), index], system.settings)
    sched.scan(system)
    assert [kind for kind, _ in sched.round(system, "local", wait=False).ran] == ["index"]

    given_up = sched.abandon(system.store, "abandoned: stopping")
    assert [kind for kind, _ in given_up] == ["index"]
    after = sched.round(system, "local", wait=False)
    index.gate.set()

    assert after.ran == [], "a round after the stop started the given-up batch again"
    assert [(t.state, t.attempts) for t in tasks(system).values()] == [(TaskState.QUEUED, 0)]
