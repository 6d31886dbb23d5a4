"""The DataCoord lifecycle step: in-process, and inside a real `vchan datacoord` process."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest
from rich.console import Console

from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import channel_segments
from vchan_assets.demo.direct import SCHEMA as DEMO_SCHEMA
from vchan_assets.demo.direct import DemoCheckError, DemoOptions, check_binlogs, produce_demo_data
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionType, PlanState, list_plans
from vchan_assets.lifecycle.step import LifecycleReport, lifecycle_step, sort_step, unsorted_segments
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import Produced
from vchan_assets.testing.steps import (
    assert_lifecycle_invariants,
    flushed_batches,
    live_l1,
    start_datacoord,
    sync_all,
)
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer


def _wait_all_sorted(store: MetaStore, collection: CollectionInfo, interval: float) -> None:
    wait_until(
        lambda: all(s.is_sorted for s in live_l1(store, collection)),
        60,
        "the datacoord process to sort every flushed segment",
        interval=interval,
        describe=lambda: f"unsorted {[s.id for s in live_l1(store, collection) if not s.is_sorted]}",
    )


def test_step_merges_small_flushed_segments_then_sorts_what_is_left_and_garbage_collects(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3)
    report = lifecycle_step(system, engine="local")
    assert report.planned and all(o.state is PlanState.COMPLETED for o in report.outcomes)
    [merged] = live_l1(store, collection)
    assert merged.is_sorted and len(merged.compaction_from) == 3
    assert report.gc is not None  # due at the first step
    # a new flushed segment is sorted by the next step (the stats task after flush)
    more = flushed_batches(system, producer, collection, batches=1, first_batch=5)
    produced.rows += more.rows
    produced.deleted += more.deleted
    single = replace(settings, compaction_small_proportion=1e-9)  # nothing is "small" now
    lifecycle_step(replace(system, settings=single), engine="local")
    assert all(s.is_sorted for s in live_l1(store, collection))
    assert all(d.model.state is PlanState.CLEANED for d in list_plans(store))
    assert_lifecycle_invariants(system, collection, produced)


def test_with_compaction_and_gc_off_the_step_only_sorts(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=3)
    off = replace(settings, compaction_enabled=False, gc_enabled=False)

    report = lifecycle_step(replace(system, settings=off), engine="local")

    assert report.gc is None  # due at the first step, but switched off
    assert {d.model.type for d in list_plans(store)} == {CompactionType.SORT}
    assert all(s.is_sorted and len(s.compaction_from) == 1 for s in live_l1(store, collection))
    assert len(live_l1(store, collection)) == 3  # nothing merged


def test_datacoord_process_runs_the_lifecycle_step_on_its_interval(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    proc = start_datacoord(settings, VCHAN_LIFECYCLE_INTERVAL="0.5")
    try:
        _wait_all_sorted(store, collection, interval=0.5)
    finally:
        proc.terminate()
        proc.wait(30)
    assert_lifecycle_invariants(system, collection, produced)


def test_sort_step_sorts_each_newly_flushed_segment_and_merges_nothing(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    flushed = live_l1(store, collection)
    assert [s.id for s in unsorted_segments(store) if s.collection_id == collection.id] == [
        s.id for s in flushed
    ]
    outcomes = sort_step(system, engine="local")
    assert len(outcomes) == 2 and all(o.state is PlanState.COMPLETED for o in outcomes)
    now = live_l1(store, collection)
    assert sorted(s.compaction_from for s in now) == [(s.id,) for s in flushed]
    assert all(s.is_sorted for s in now)
    assert sort_step(system, engine="local") == []  # nothing new: no plan
    assert_lifecycle_invariants(system, collection, produced)


def test_datacoord_process_sorts_a_segment_soon_after_its_flush_not_at_the_lifecycle_interval(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    proc = start_datacoord(
        settings,
        VCHAN_LIFECYCLE_INTERVAL="3600",
        VCHAN_SORT_SCAN_INTERVAL="3600",
        VCHAN_COMPACTION_CHECK_INTERVAL="3600",  # no merge: each sorted on its own
    )
    produced = Produced()
    try:
        for batch in range(2):  # each flush, sorted on its own before the next one
            more = flushed_batches(system, producer, collection, batches=1, first_batch=batch)
            produced.rows += more.rows
            produced.deleted += more.deleted
            [flushed] = [s for s in live_l1(store, collection) if not s.is_sorted]
            _wait_all_sorted(store, collection, interval=0.2)
            assert (flushed.id,) in [s.compaction_from for s in live_l1(store, collection)]
    finally:
        proc.terminate()
        proc.wait(30)
    assert len(live_l1(store, collection)) == 2, "sorted one by one, not merged (no lifecycle step ran)"
    assert_lifecycle_invariants(system, collection, produced)


def test_step_fails_a_plan_past_the_timeout_then_deletes_it_after_the_plan_retention(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    inputs = {s.id for s in live_l1(store, collection)}
    [plan] = CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    [pending] = list_plans(store)
    assert isinstance(CompactionExecutor(system, "local").start(pending), tuple)
    started = time.time()  # the plan is Executing now; its executor never finishes it
    timing = replace(settings, compaction_timeout=60.0, compaction_plan_retention=600.0)

    def step(now: float) -> LifecycleReport:
        return lifecycle_step(
            replace(system, settings=timing), engine="local", now=now, compact=False, collect=False
        )

    assert step(started + 30).timed_out == []
    [running] = list_plans(store)
    assert running.model.state is PlanState.EXECUTING
    report = step(started + 61)
    assert report.timed_out == [plan.plan_id] and report.cleaned == [plan.plan_id]
    [cleaned] = list_plans(store)
    assert cleaned.model.state is PlanState.CLEANED and cleaned.model.reason == "timed out"
    assert {s.id for s in live_l1(store, collection)} == inputs, "the inputs stay live"
    assert step(started + 61 + 599).deleted_plans == []  # still listed by status for a while
    assert step(started + 61 + 601).deleted_plans == [plan.plan_id]
    assert list_plans(store) == []
    assert_lifecycle_invariants(system, collection, produced)


def test_the_demo_check_reads_a_segment_the_sort_replaced_from_the_sorted_one(
    system: System, store: MetaStore, storage: Storage, producer: Producer
) -> None:
    """`make demo` under Dagster: the sort sensor ran between the flush and the demo's
    check, which then found the unsorted segment Dropped and failed ("segment 105 is
    Dropped after the flush") though every row was there once, in the sorted segment."""
    info = producer.create_collection(f"demo{uuid.uuid4().hex[:8]}", DEMO_SCHEMA, num_channels=2)
    options = DemoOptions(rows=600, batch=200, deletes=12, channels=2)
    deleted, _, _ = produce_demo_data(producer, info.name, options, Console(quiet=True))
    sync_all(system, info)
    outcomes = sort_step(system, engine="local")
    assert outcomes and all(o.state is PlanState.COMPLETED for o in outcomes)
    states = [s.model.state for v in info.vchannels for s in channel_segments(store, info.id, v)]
    assert SegmentState.DROPPED in states

    check_binlogs(store, storage, info, options.rows, deleted)

    # A Dropped segment that nothing replaced is still an error.
    lost = next(s for s in live_l1(store, info))
    key = store.keys.segment(lost.collection_id, lost.partition_id, lost.id)
    store.put(key, replace(lost, state=SegmentState.DROPPED))
    with pytest.raises(DemoCheckError, match=r"segment \d+ is Dropped after the flush"):
        check_binlogs(store, storage, info, options.rows, deleted)
