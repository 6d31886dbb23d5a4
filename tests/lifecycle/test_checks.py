"""The lifecycle's invariant checks (what the Dagster lifecycle assets report): each passes
on a sound collection, fails naming what is wrong when its invariant is broken, and a
delete synced after a compaction does not make the rows check fail. Real etcd and files."""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.catalog import Catalog
from vchan_assets.lifecycle.checks import (
    check_live_files_exist,
    check_rows_conserved,
    check_unique_live_pks,
)
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionPlan, CompactionType, PlanState
from vchan_assets.lifecycle.step import lifecycle_step
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced
from vchan_assets.testing.steps import flushed_batches, live_l1, sync_all
from vchan_assets.wal.producer import Producer, generate_rows


def merged(system: System, producer: Producer, info: CollectionInfo) -> tuple[Produced, CompactionPlan]:
    """Two flushed rounds with deletes merged into one segment: the produced rows and the plan."""
    produced = flushed_batches(system, producer, info, batches=2)
    [plan] = CompactionTrigger(system).trigger(info, CompactionType.MIX)
    [outcome] = CompactionExecutor(system, "local").run_pending()
    assert outcome.state is PlanState.COMPLETED, outcome.reason
    done = system.store.get_model(system.store.keys.compaction_plan(plan.plan_id), CompactionPlan)
    assert done is not None
    return produced, done.model


def test_rows_check_passes_after_a_compaction_and_fails_when_its_output_lost_rows(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    _, plan = merged(system, producer, collection)
    assert plan.rows_out < plan.rows_in, "the merge removed deleted rows"
    assert check_rows_conserved(store, storage, [plan]).passed
    lossy = replace(plan, rows_out=plan.rows_out - 1)  # what a task dropping a row would record
    outcome = check_rows_conserved(store, storage, [lossy])
    assert not outcome.passed and f"plan {plan.plan_id}" in outcome.description


def test_rows_check_after_a_delete_synced_since_the_compaction_still_passes(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    _, plan = merged(system, producer, collection)
    # A sync commits new deletes of merged rows between the compaction and the check:
    # the compaction could not apply them, so the check must not count them.
    producer.delete(collection.name, [20, 10_020], partition="_default")
    sync_all(system, collection)
    outcome = check_rows_conserved(store, storage, [plan])
    assert outcome.passed, outcome.description


def test_unique_pk_check_fails_naming_the_count_when_a_pk_is_in_two_live_segments(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    _, plan = merged(system, producer, collection)
    assert check_unique_live_pks(store, storage).passed
    # A commit that forgot to drop an input: its rows are live twice.
    door = SegmentMeta(store)
    found = door.get(collection.id, plan.partition_id, plan.input_ids[0], include_dropped=True)
    assert found is not None and found.model.state is SegmentState.DROPPED
    flushed = found.model.with_changes(state=SegmentState.FLUSHED)
    assert store.txn({found.kv.key: found.kv.version}, door.create_puts(flushed), [found.kv.key]) is not None
    outcome = check_unique_live_pks(store, storage)
    kept = found.model.num_rows - 10  # the merge removed the round's 10 deleted rows
    assert not outcome.passed and outcome.metadata["duplicates"] == kept
    assert f"{kept} duplicated primary keys" in outcome.description


def test_files_check_fails_naming_a_file_live_meta_names_and_storage_lost(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    merged(system, producer, collection)
    assert check_live_files_exist(store, storage).passed
    [segment] = live_l1(store, collection)
    victim = segment.binlogs[0].logs[0].path
    storage.delete(victim)
    outcome = check_live_files_exist(store, storage)
    assert not outcome.passed and victim in outcome.description


def test_a_pk_deleted_then_inserted_again_is_one_live_row_for_the_pk_check_and_after_compaction(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=1)  # 0..9 deleted
    again = generate_rows(SCHEMA, 5, start_pk=0, seed=777)  # pks 0..4 inserted again, newer than the delete
    producer.insert(collection.name, again)
    producer.flush(collection.name)
    sync_all(system, collection)
    # The old rows of 0..4 are still in the first segment's files, deleted: not a duplicate.
    outcome = check_unique_live_pks(store, storage)
    assert outcome.passed, outcome.description
    report = lifecycle_step(system, engine="local", collect=False)  # L0, then merge
    assert {p.type for p in list_plans_of(store, report.planned)} >= {CompactionType.L0, CompactionType.MIX}
    assert all(o.state is PlanState.COMPLETED for o in report.outcomes), report.outcomes
    assert check_unique_live_pks(store, storage).passed
    rows = Catalog(system).read_collection(collection.name, as_arrow=True)
    assert isinstance(rows, pa.Table)
    visible = sorted(rows["pk"].to_pylist())
    first = sorted(set(produced.table["pk"].to_pylist()) - set(produced.deleted))
    assert visible == sorted([*first, *range(5)])  # each once: the deletes kept their timestamps
    newer = rows.filter(pc.less(rows["pk"], 5)).sort_by("pk")
    assert newer["n"].equals(again.sort_by("pk")["n"]), "the row inserted after the delete is the one kept"


def list_plans_of(store: MetaStore, plan_ids: list[int]) -> list[CompactionPlan]:
    found = [store.get_model(store.keys.compaction_plan(p), CompactionPlan) for p in plan_ids]
    return [d.model for d in found if d is not None]
