"""Sort (stats task) and mix compaction: plans in etcd, one commit that swaps inputs for
outputs, the loser of a race aborts cleanly. Real etcd, real files, local engine (one
test runs the plans as a Spark job)."""

from __future__ import annotations

import time
from dataclasses import replace

from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.recovery import list_orphans
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger, input_memory_mb
from vchan_assets.lifecycle.plans import (
    CompactionPlan,
    CompactionType,
    PlanState,
    create_plan,
    list_plans,
)
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, segments
from vchan_assets.testing.steps import assert_lifecycle_invariants, flushed_batches, live_l1, sync_all
from vchan_assets.wal.producer import Producer, generate_rows


def executor(system: System, **settings: object) -> CompactionExecutor:
    """A compaction executor (local engine) of `system`, with `settings` changed."""
    return CompactionExecutor(replace(system, settings=replace(system.settings, **settings)), engine="local")


def test_plans_are_admitted_by_memory_estimate_and_the_rest_run_in_a_later_job(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3)
    before = live_l1(store, collection)
    one = max(input_memory_mb([s]) for s in before)
    plans = CompactionTrigger(system).trigger(collection, CompactionType.SORT)
    tight = executor(system, task_memory_mb=one * 2.5)  # two plans fit

    outcomes = tight.run_pending()

    assert [len(job) for job in tight.jobs] == [2, 1]
    assert sorted(p for job in tight.jobs for p in job) == sorted(p.plan_id for p in plans)
    assert [o.state for o in outcomes] == [PlanState.COMPLETED] * 3
    assert_lifecycle_invariants(system, collection, produced)


def test_sort_rewrites_each_flushed_segment_sorted_and_drops_the_old_one_in_one_commit(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    before = live_l1(store, collection)
    assert before and not any(s.is_sorted for s in before)
    plans = CompactionTrigger(system).trigger(collection, CompactionType.SORT)
    assert sorted(p.input_ids[0] for p in plans) == sorted(s.id for s in before)
    outcomes = executor(system).run_pending()
    assert [o.state for o in outcomes] == [PlanState.COMPLETED] * len(before)
    after = live_l1(store, collection)
    assert all(s.is_sorted and len(s.compaction_from) == 1 for s in after)
    assert {s.compaction_from[0] for s in after} == {s.id for s in before}
    dropped = {s.id for s in segments(store, collection) if s.state is SegmentState.DROPPED}
    assert {s.id for s in before} <= dropped
    assert_lifecycle_invariants(system, collection, produced)
    assert all(d.model.state is PlanState.CLEANED for d in list_plans(store))


def test_mix_merges_small_segments_removing_deleted_rows_into_one_sorted_segment(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3)
    before = live_l1(store, collection)
    assert len(before) == 3
    plans = CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    assert len(plans) == 1 and sorted(plans[0].input_ids) == sorted(s.id for s in before)
    [outcome] = executor(system).run_pending()
    assert outcome.state is PlanState.COMPLETED, outcome.reason
    [merged] = live_l1(store, collection)
    assert merged.is_sorted and sorted(merged.compaction_from) == sorted(s.id for s in before)
    # rows before = rows after + the deletes applied physically
    assert merged.num_rows == sum(s.num_rows for s in before) - len(produced.deleted)
    plan = store.get_model(store.keys.compaction_plan(outcome.plan_id), CompactionPlan)
    assert plan is not None and plan.model.rows_in - plan.model.rows_out == len(produced.deleted)
    pks = storage.read_parquet(merged.binlogs[0].logs[0].path)["pk"].to_pylist()
    assert pks == sorted(pks)
    assert_lifecycle_invariants(system, collection, produced)


def test_mix_output_is_cut_at_the_max_segment_size(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3, deletes=0)
    row_mb = collection.schema.row_bytes() / (1 << 20)
    small = replace(
        system, settings=replace(system.settings, segment_max_size_mb=250 * row_mb)
    )  # 250 rows a segment
    plans = CompactionTrigger(small).trigger(collection, CompactionType.MIX, manual=True)
    assert plans
    outcomes = executor(small).run_pending()
    assert all(o.state is PlanState.COMPLETED for o in outcomes)
    assert all(s.num_rows <= 250 for s in live_l1(store, collection))
    assert_lifecycle_invariants(system, collection, produced)


def test_compaction_never_plans_growing_sealed_or_flushing_segments(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=2)
    producer.insert(
        collection.name,
        generate_rows(SCHEMA, 50, start_pk=99_000),
    )
    sync_all(system, collection)
    growing = [s.id for s in segments(store, collection) if s.state is not SegmentState.FLUSHED]
    assert growing
    trigger = CompactionTrigger(system)
    planned = {
        i
        for kind in CompactionType
        if kind is not CompactionType.L0
        for p in trigger.trigger(collection, kind, manual=True)
        for i in p.input_ids
    }
    assert planned and not planned & set(growing)


def _bump(store: MetaStore, seg: SegmentInfo) -> None:
    """What a sync or flush commit does to a segment's meta: a new version."""
    key = store.keys.segment(seg.collection_id, seg.partition_id, seg.id)
    found = store.get_model(key, SegmentInfo)
    assert found is not None
    store.cas(key, found.kv.version, found.model.with_changes(last_insert_at=1.0))


def test_compaction_whose_input_changed_after_its_files_were_written_aborts_and_inputs_stay_live(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    before = live_l1(store, collection)
    [plan] = CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    ex = executor(system)
    [pending] = [d for d in list_plans(store) if d.model.plan_id == plan.plan_id]
    started = ex.start(pending)
    assert isinstance(started, tuple)
    running, spec = started
    [result] = ex._run([spec])
    _bump(store, before[0])  # a sync/flush commit lands between the files and the commit
    outcome = ex.finish(running, result)
    assert outcome.state is PlanState.FAILED and "version" in outcome.reason
    assert {s.id for s in live_l1(store, collection)} == {s.id for s in before}
    assert_lifecycle_invariants(system, collection, produced)
    orphans = list_orphans(store, storage)
    assert any(f"/{plan.output_ids[0]}/" in o for o in orphans), "the loser's files are orphans"


def test_two_plans_of_the_same_segments_the_second_commit_aborts(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    trigger = CompactionTrigger(system)
    [first] = trigger.trigger(collection, CompactionType.MIX)
    # The trigger never plans a busy segment; force a rival plan on the same inputs.
    rival = replace(first, plan_id=first.plan_id + 10_000_000, output_ids=(first.output_ids[0] + 10_000_000,))
    create_plan(store, rival)
    ex = executor(system)
    a = ex.start([d for d in list_plans(store) if d.model.plan_id == first.plan_id][0])
    b = ex.start([d for d in list_plans(store) if d.model.plan_id == rival.plan_id][0])
    assert isinstance(a, tuple) and isinstance(b, tuple)
    ra, rb = ex._run([a[1], b[1]])
    assert ex.finish(a[0], ra).state is PlanState.COMPLETED
    lost = ex.finish(b[0], rb)
    assert lost.state is PlanState.FAILED
    assert len(live_l1(store, collection)) == 1
    assert_lifecycle_invariants(system, collection, produced)


def test_corrupt_input_binlog_fails_that_plan_naming_the_file_and_other_plans_go_on(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=2)
    before = live_l1(store, collection)
    bad = before[0].binlogs[0].logs[0].path
    storage.write_atomic(bad, b"not parquet")
    CompactionTrigger(system).trigger(collection, CompactionType.SORT)
    outcomes = {o.state: o for o in executor(system).run_pending()}
    assert set(outcomes) == {PlanState.FAILED, PlanState.COMPLETED}
    assert bad in outcomes[PlanState.FAILED].reason
    assert before[0].id in {s.id for s in live_l1(store, collection)}, "the corrupt input stays live"
    plan = store.get_model(store.keys.compaction_plan(outcomes[PlanState.FAILED].plan_id), CompactionPlan)
    assert plan is not None and bad in plan.model.reason


def test_sort_and_mix_run_as_one_spark_job(
    system: System, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    CompactionTrigger(system).trigger(collection, CompactionType.SORT)
    outcomes = CompactionExecutor(system, engine="spark").run_pending()
    assert outcomes and all(o.state is PlanState.COMPLETED for o in outcomes)
    assert_lifecycle_invariants(system, collection, produced)


def test_catalog_lists_plans_and_lineage_and_never_shows_an_input_with_its_output(
    system: System, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=2)
    CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    [outcome] = executor(system).run_pending()
    catalog = Catalog(system)
    plans = catalog.compactions(collection.name)
    assert list(plans["plan_id"]) == [outcome.plan_id]
    assert plans.iloc[0]["type"] == "mix" and plans.iloc[0]["state"] == "Cleaned"
    table = catalog.segments(collection.name, include_dropped=False)
    merged = table[table["segment_id"] == outcome.outputs[0]].iloc[0]
    assert merged["is_sorted"] and sorted(merged["compaction_from"]) == sorted(plans.iloc[0]["inputs"])
    assert not set(merged["compaction_from"]) & set(table["segment_id"])
    rows = catalog.read_collection(collection.name)
    assert set(rows["segment_id"]) <= set(table["segment_id"])


def test_l0_compaction_moves_deletes_into_the_segments_holding_their_pks_and_drops_the_l0_segments(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3)
    l0 = [
        s
        for s in segments(store, collection)
        if s.level is SegmentLevel.L0 and s.state is SegmentState.FLUSHED
    ]
    assert len(l0) == 3
    [plan] = CompactionTrigger(system).trigger(collection, CompactionType.L0)
    [outcome] = executor(system).run_pending()
    assert outcome.state is PlanState.COMPLETED, outcome.reason
    after = {s.id: s for s in segments(store, collection)}
    assert all(after[s.id].state is SegmentState.DROPPED for s in l0)
    # each batch deleted its own first pks: exactly the segment of that batch got them
    targets = [s for s in live_l1(store, collection) if s.deltalogs]
    assert len(targets) == 3 and all(s.state is SegmentState.FLUSHED for s in targets)
    assert all(len(s.deltalogs) == 1 for s in targets), "one delta log per target"
    moved = sorted(
        pk for s in targets for b in s.deltalogs for pk in storage.read_parquet(b.path)["pk"].to_pylist()
    )
    assert moved == sorted(produced.deleted)
    assert_lifecycle_invariants(system, collection, produced)
    # then a mix compaction removes the rows physically and keeps nothing deleted
    CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    assert all(o.state is PlanState.COMPLETED for o in executor(system).run_pending())
    assert_lifecycle_invariants(system, collection, produced)


def test_l0_compaction_waits_while_a_segment_that_may_hold_older_rows_is_not_flushed(
    system: System, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=1)
    producer.insert(collection.name, generate_rows(SCHEMA, 50, start_pk=99_000))
    producer.delete(collection.name, [99_000], partition="_default")
    sync_all(system, collection)  # the deleted row sits in a Growing segment
    assert CompactionTrigger(system).trigger(collection, CompactionType.L0) == []


def test_l0_compaction_under_continuous_writes_takes_the_deletes_older_than_every_unflushed_segment(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=2)
    older = {s.id for s in segments(store, collection) if s.level is SegmentLevel.L0}
    time.sleep(1.2)  # the next round's segment is created more than the 1 s margin later
    producer.insert(collection.name, generate_rows(SCHEMA, 50, start_pk=99_000))  # a round in flight
    producer.delete(collection.name, [0, 1], partition="_default")  # deletes newer than its segment
    sync_all(system, collection)  # the rows sit in a Growing segment, the deletes in L0
    newest = {s.id for s in segments(store, collection) if s.level is SegmentLevel.L0} - older
    assert newest and any(s.state is SegmentState.GROWING for s in segments(store, collection))
    [plan] = CompactionTrigger(system).trigger(collection, CompactionType.L0)
    assert older <= set(plan.input_ids) and not newest & set(plan.input_ids)


def test_status_lists_the_compaction_plans(
    system: System, producer: Producer, collection: CollectionInfo
) -> None:
    from rich.console import Console

    from vchan_assets.status import SegmentDetail, collect_status, render_status

    flushed_batches(system, producer, collection, batches=2)
    CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    report = collect_status(Catalog(system), orphans=False)
    [plan] = report["compactions"]
    assert plan["state"] == "Pending" and plan["type"] == "mix" and len(plan["inputs"]) == 2
    console = Console(width=200, record=True)
    console.print(render_status(report))
    text = console.export_text()
    assert "compaction plans" in text and f"{plan['plan_id']:,}" in text
    # once run: the merged segment counts as sorted and compacted, its inputs as Dropped
    assert all(o.state is PlanState.COMPLETED for o in executor(system).run_pending())
    report = collect_status(Catalog(system), segments=SegmentDetail())  # no DataCoord: no summary
    by_state = {(s["state"], s["level"]): s for s in report["segments"] if s["collection"] == collection.name}
    assert by_state[("Flushed", "L1")]["segments"] == by_state[("Flushed", "L1")]["sorted"] == 1
    assert by_state[("Flushed", "L1")]["compacted"] == 1 and by_state[("Dropped", "L1")]["segments"] == 2
    console = Console(width=200, record=True)
    console.print(render_status(report))
    assert "compacted" in console.export_text()
