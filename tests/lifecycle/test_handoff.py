"""The hand-off after flush (Milvus' postFlush): a flush leaves an L1 segment Flushed and
invisible, readers serve it as growing, and its sorted copy replaces it in one commit; the
DataCoord hears of each flush from an etcd watch on segment meta, not from a poll."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from rich.console import Console

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.handoff import SortQueue
from vchan_assets.lifecycle.plans import CompactionType, PlanState, list_plans, transition
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentLevel, SegmentState
from vchan_assets.query.view import read_query_view
from vchan_assets.status import SegmentDetail, collect_status, render_status
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, VCHAN, cli_env, segments
from vchan_assets.testing.steps import assert_lifecycle_invariants, flushed_batches, live_l1
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer


def invisible_ids(store: MetaStore, info: CollectionInfo) -> set[int]:
    return {s.id for s in live_l1(store, info) if s.is_invisible}


def wait_until_sorted(
    store: MetaStore, info: CollectionInfo, proc: subprocess.Popen[bytes], timeout: float
) -> float:
    """Wait until every live segment is sorted and visible (the DataCoord process alive)."""

    def done() -> bool:
        live = live_l1(store, info)
        if live and all(s.is_sorted and not s.is_invisible for s in live):
            return True
        assert proc.poll() is None, f"vchan datacoord exited with {proc.returncode}"
        return False

    return wait_until(done, timeout, "every live segment sorted", describe=lambda: live_l1(store, info))


def test_a_flush_leaves_l1_segments_flushed_and_invisible_and_l0_segments_visible(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=1)
    segs = segments(store, collection)
    l1 = [s for s in segs if s.level is not SegmentLevel.L0]
    l0 = [s for s in segs if s.level is SegmentLevel.L0]
    assert l1 and all(s.state is SegmentState.FLUSHED and s.is_invisible for s in l1)
    assert all(s.flushed_at is not None and s.flushed_at <= time.time() for s in l1)
    assert l0 and all(s.state is SegmentState.FLUSHED and not s.is_invisible for s in l0)
    view = read_query_view(store, collection, collection.vchannels[0])
    assert {s.id for s in l1} <= view.growing_ids and not view.flushed_ids


def test_the_sort_replaces_the_invisible_segment_with_a_visible_sorted_copy_in_one_commit(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    before = invisible_ids(store, collection)
    rows_before = Catalog(system).read_collection(collection.name)["pk"].sort_values().tolist()
    assert len(before) == 2
    outcomes = sort_step(system, engine="local")
    assert [o.state for o in outcomes] == [PlanState.COMPLETED] * 2
    now = live_l1(store, collection)
    assert all(s.is_sorted and not s.is_invisible for s in now)
    assert {s.compaction_from for s in now} == {(i,) for i in before}
    parents = {s.id: s for s in segments(store, collection) if s.id in before}
    assert all(p.state is SegmentState.DROPPED and p.dropped_at for p in parents.values())
    view = read_query_view(store, collection, collection.vchannels[0])
    assert view.flushed_ids == {s.id for s in now} and not view.growing_ids
    assert Catalog(system).read_collection(collection.name)["pk"].sort_values().tolist() == rows_before
    assert_lifecycle_invariants(system, collection, produced)


def test_a_mix_of_invisible_segments_replaces_them_with_one_visible_sorted_segment(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    invisible = invisible_ids(store, collection)
    [plan] = CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    assert {i.segment_id for i in plan.inputs} == invisible and len(invisible) == 2
    [outcome] = CompactionExecutor(system, "local").run_pending()
    assert outcome.state is PlanState.COMPLETED
    [merged] = live_l1(store, collection)
    assert merged.is_sorted and not merged.is_invisible
    view = read_query_view(store, collection, collection.vchannels[0])
    assert view.flushed_ids == {merged.id} and not view.growing_ids
    assert_lifecycle_invariants(system, collection, produced)


def test_the_sort_queue_hears_of_each_flush_through_the_watch(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=1)
    first = invisible_ids(store, collection)
    queue = SortQueue()
    with queue.watch(store):  # flushed before the watcher started: found by its first listing
        assert queue.take(10) == {collection.id: first}
        flushed_batches(system, producer, collection, batches=1, first_batch=1)
        pushed = queue.take(10)
        assert pushed == {collection.id: invisible_ids(store, collection) - first}
        sort_step(system, engine="local", collections=set(pushed))
        time.sleep(0.5)  # the sort's commit: its visible, sorted outputs need no sort
        assert queue.take(0.5) == {}


def test_datacoord_sorts_a_flush_it_was_not_running_for_at_its_start_not_at_the_scan(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    env = cli_env(
        settings,
        VCHAN_LIFECYCLE_INTERVAL="3600",
        VCHAN_SORT_SCAN_INTERVAL="3600",
        VCHAN_COMPACTION_CHECK_INTERVAL="3600",
    )
    proc = subprocess.Popen([str(VCHAN), "datacoord", "--engine", "local"], env=env)
    try:
        wait_until_sorted(store, collection, proc, timeout=60)
    finally:
        proc.terminate()
        proc.wait(30)
    assert len(live_l1(store, collection)) == 2, "sorted one by one (no lifecycle step ran)"
    assert_lifecycle_invariants(system, collection, produced)


def test_datacoord_killed_after_the_push_before_the_sort_leaves_nothing_invisible(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo, tmp_path: Path
) -> None:
    timing = {
        "VCHAN_LIFECYCLE_INTERVAL": "3600",
        "VCHAN_SORT_SCAN_INTERVAL": "3600",
        "VCHAN_COMPACTION_CHECK_INTERVAL": "3600",
    }
    marker = tmp_path / "failpoint"
    first = subprocess.Popen(
        [str(VCHAN), "datacoord", "--engine", "local"],
        env=cli_env(
            system.settings,
            VCHAN_FAILPOINT="handoff_taken=kill",
            VCHAN_FAILPOINT_MARKER=str(marker),
            **timing,
        ),
    )
    try:
        wait_until(
            lambda: first.poll() is not None or store.get(store.keys.datacoord_session()) is not None,
            60,
            "the first DataCoord to become active (or exit)",
        )
        produced = flushed_batches(system, producer, collection, batches=1)
        assert first.wait(60) == -signal.SIGKILL, "killed at the failpoint, right after the push"
        assert marker.read_text().startswith("handoff_taken")
        assert invisible_ids(store, collection), "not sorted by the killed DataCoord"
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
    second = subprocess.Popen(
        [str(VCHAN), "datacoord", "--engine", "local"], env=cli_env(system.settings, **timing)
    )
    try:
        wait_until_sorted(store, collection, second, timeout=90)
    finally:
        second.terminate()
        second.wait(30)
    assert not invisible_ids(store, collection)
    assert_lifecycle_invariants(system, collection, produced)


def test_a_datacoord_killed_mid_sort_leaves_its_plans_to_the_standby_at_once(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo, tmp_path: Path
) -> None:
    """Kill -9 of the active DataCoord with its sort plans Executing (files written, no
    commit), a standby running: the standby fails and cleans the dead term's plans as soon
    as it leads and sorts the segments again, long before VCHAN_COMPACTION_TIMEOUT (an hour
    here). Before plans named their worker, the standby's sort tasks were deferred, twice a
    second, until the timeout, and the segments stayed invisible as long."""
    timing = {
        "VCHAN_LIFECYCLE_INTERVAL": "3600",
        "VCHAN_SORT_SCAN_INTERVAL": "3600",
        "VCHAN_COMPACTION_CHECK_INTERVAL": "3600",
        "VCHAN_COMPACTION_TIMEOUT": "3600",
    }
    marker = tmp_path / "failpoint"
    env = cli_env(system.settings, **timing)
    first = subprocess.Popen(
        [str(VCHAN), "datacoord", "--engine", "local"],
        env={**env, "VCHAN_FAILPOINT": "compaction_after_files=kill", "VCHAN_FAILPOINT_MARKER": str(marker)},
    )
    standby: subprocess.Popen[bytes] | None = None
    try:
        wait_until(
            lambda: first.poll() is not None or store.get(store.keys.datacoord_session()) is not None,
            60,
            "the first DataCoord active",
        )
        standby = subprocess.Popen([str(VCHAN), "datacoord", "--engine", "local"], env=env)
        produced = flushed_batches(system, producer, collection, batches=1)
        assert first.wait(120) == -signal.SIGKILL, "killed with its sort's files written"
        assert marker.read_text().startswith("compaction_after_files")
        [dead] = [d.model for d in list_plans(store) if d.model.state is PlanState.EXECUTING]
        assert dead.worker.endswith(f"@{dead.worker.rpartition('@')[2]}") and f":{first.pid}@" in dead.worker
        wait_until_sorted(store, collection, standby, timeout=180)
    finally:
        for proc in (first, standby):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    [released] = [d.model for d in list_plans(store) if d.model.plan_id == dead.plan_id]
    assert released.state is PlanState.CLEANED and "ended" in released.reason, released
    assert not invisible_ids(store, collection)
    assert_lifecycle_invariants(system, collection, produced)


def test_status_says_what_each_late_invisible_segment_waits_on(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    """Past the late threshold, `vchan status` names for each invisible segment what holds
    it: a compaction plan and its worker, its sort task's state, or nothing (no DataCoord)."""
    flushed_batches(system, producer, collection, batches=2)
    held, *free = sorted(invisible_ids(store, collection))
    [plan] = CompactionTrigger(system).trigger(collection, CompactionType.SORT, segments={held})
    [d] = [d for d in list_plans(store) if d.model.plan_id == plan.plan_id]
    transition(store, d, state=PlanState.EXECUTING, worker="elsewhere:1@7", started_at=time.time())

    later = time.time() + 600
    with Catalog(system) as catalog:
        report = collect_status(catalog, now=later, segments=SegmentDetail())
    waits = {r["segment"]: r["waits_on"] for r in report["handoff"]["stuck"]}
    assert waits[held] == f"compaction plan {plan.plan_id} (sort, Executing on elsewhere:1@7)"
    assert free and all("no sort task or plan holds it" in waits[f] for f in free)
    [warning] = [w for w in report["warnings"] if w["kind"] == "sort_behind"]
    assert f"segment {held} waits on compaction plan {plan.plan_id}" in warning["message"]


def test_a_push_spent_while_another_plan_held_the_segments_is_made_good_by_the_scan(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    """The safety net: the flush's push arrives while another plan holds its segments, so
    the sort plans nothing; when that plan fails no push comes again (segment meta did not
    change). The periodic scan sorts them: nothing stays invisible."""
    produced = flushed_batches(system, producer, collection, batches=2)
    [held] = CompactionTrigger(system).trigger(collection, CompactionType.MIX)  # never run here
    timing = {"VCHAN_LIFECYCLE_INTERVAL": "3600", "VCHAN_SORT_SCAN_INTERVAL": "3"}
    proc = subprocess.Popen([str(VCHAN), "datacoord", "--engine", "local"], env=cli_env(settings, **timing))
    try:
        # Another collection's flush, pushed after this one's: once it is sorted, the
        # DataCoord has taken this collection's push too, and found its segments busy.
        other = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
        flushed_batches(system, producer, other, batches=1)
        wait_until_sorted(store, other, proc, timeout=60)
        assert len(invisible_ids(store, collection)) == 2, "the push is spent"
        [plan] = [d for d in list_plans(store) if d.model.plan_id == held.plan_id]
        assert transition(store, plan, state=PlanState.FAILED, reason="its executor died")
        wait_until_sorted(store, collection, proc, timeout=60)
    finally:
        proc.terminate()
        proc.wait(30)
    assert not invisible_ids(store, collection)
    assert_lifecycle_invariants(system, collection, produced)


def test_status_and_the_catalog_show_invisible_segments_the_flush_to_sorted_latency_and_a_late_sort(
    system: System, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=2)
    catalog = Catalog(system)
    report = collect_status(catalog, segments=SegmentDetail())  # no DataCoord here: no summary
    assert report["handoff"]["invisible"] == 2 and report["handoff"]["sorted"] == 0
    [row] = [s for s in report["segments"] if s["collection"] == collection.name and s["level"] == "L1"]
    assert row["state"] == "Flushed" and row["invisible"] == 2
    assert not [w for w in report["warnings"] if w["kind"] == "sort_behind"]
    late = collect_status(catalog, now=time.time() + 3600, segments=SegmentDetail())
    [warning] = [w for w in late["warnings"] if w["kind"] == "sort_behind"]
    assert "2 flushed segments still invisible" in warning["message"]

    sort_step(system, engine="local")
    report = collect_status(catalog, segments=SegmentDetail())
    handoff = report["handoff"]
    assert handoff["invisible"] == 0 and handoff["sorted"] == 2
    assert 0 <= handoff["flush_to_sorted_p50_s"] <= handoff["flush_to_sorted_p95_s"] < 600
    table = catalog.segments(collection.name)
    replaced = table[table["flush_to_sorted_s"].notna()]
    assert len(replaced) == 2 and set(replaced["state"]) == {"Dropped"} and replaced["invisible"].all()
    console = Console(record=True, width=200)
    console.print(render_status(report))
    assert "hand-off: 0 invisible; flush -> sorted p50" in console.export_text()
