"""The lifecycle's invariant checks (what the Dagster lifecycle assets report): each passes
on a sound collection, fails naming what is wrong when its invariant is broken, and a
delete synced after a compaction does not make the rows check fail. Real etcd and files."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from vchan_assets.config import Settings
from vchan_assets.lifecycle.checks import (
    check_live_files_exist,
    check_rows_conserved,
    check_unique_live_pks,
)
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionPlan, CompactionType, PlanState
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer

from .helpers import SCHEMA, Produced, flushed_batches, live_l1, sync_all


@pytest.fixture
def collection(producer: Producer) -> CollectionInfo:
    return producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)


def merged(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, info: CollectionInfo
) -> tuple[Produced, CompactionPlan]:
    """Two flushed rounds with deletes merged into one segment: the produced rows and the plan."""
    produced = flushed_batches(store, storage, settings, producer, info, batches=2)
    [plan] = CompactionTrigger(store, storage, settings).trigger(info, CompactionType.MIX)
    [outcome] = CompactionExecutor(store, storage, settings, "local").run_pending()
    assert outcome.state is PlanState.COMPLETED, outcome.reason
    done = store.get_model(store.keys.compaction_plan(plan.plan_id), CompactionPlan)
    assert done is not None
    return produced, done.model


def test_rows_check_passes_after_a_compaction_and_fails_when_its_output_lost_rows(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    _, plan = merged(store, storage, settings, producer, collection)
    assert plan.rows_out < plan.rows_in, "the merge removed deleted rows"
    assert check_rows_conserved(store, storage, [plan]).passed
    lossy = replace(plan, rows_out=plan.rows_out - 1)  # what a task dropping a row would record
    outcome = check_rows_conserved(store, storage, [lossy])
    assert not outcome.passed and f"plan {plan.plan_id}" in outcome.description


def test_rows_check_after_a_delete_synced_since_the_compaction_still_passes(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    _, plan = merged(store, storage, settings, producer, collection)
    # A sync commits new deletes of merged rows between the compaction and the check:
    # the compaction could not apply them, so the check must not count them.
    producer.delete(collection.name, [20, 10_020], partition="_default")
    sync_all(store, storage, settings, collection)
    outcome = check_rows_conserved(store, storage, [plan])
    assert outcome.passed, outcome.description


def test_unique_pk_check_fails_naming_the_count_when_a_pk_is_in_two_live_segments(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    _, plan = merged(store, storage, settings, producer, collection)
    assert check_unique_live_pks(store, storage).passed
    # A commit that forgot to drop an input: its rows are live twice.
    key = store.keys.segment(collection.id, plan.partition_id, plan.input_ids[0])
    found = store.get_model(key, SegmentInfo)
    assert found is not None and found.model.state is SegmentState.DROPPED
    store.cas(key, found.kv.version, found.model.with_changes(state=SegmentState.FLUSHED))
    outcome = check_unique_live_pks(store, storage)
    kept = found.model.num_rows - 10  # the merge removed the round's 10 deleted rows
    assert not outcome.passed and outcome.metadata["duplicates"] == kept
    assert f"{kept} duplicated primary keys" in outcome.description


def test_files_check_fails_naming_a_file_live_meta_names_and_storage_lost(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    merged(store, storage, settings, producer, collection)
    assert check_live_files_exist(store, storage).passed
    [segment] = live_l1(store, collection)
    victim = segment.binlogs[0].logs[0].path
    storage.delete(victim)
    outcome = check_live_files_exist(store, storage)
    assert not outcome.passed and victim in outcome.description
