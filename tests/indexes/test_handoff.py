"""Hand-off waits for the index: a mix compaction output of an indexed collection replaces
its indexed inputs in the query view only once its own build is Finished (the commit
stamps its `ready_ts`), a read in the past keeps the segments it served then, and GC keeps
the inputs' meta, files and index files until then. A build Failed for good, or a wait
past VCHAN_INDEX_HANDOFF_TIMEOUT, releases the output without its index."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.indexes.gc import collect_indexes
from vchan_assets.indexes.meta import list_builds, list_indexes, release_waiting_outputs
from vchan_assets.indexes.step import index_step
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector, GcReport
from vchan_assets.lifecycle.plans import CompactionType
from vchan_assets.meta.allocator import now_ts
from vchan_assets.model import SegmentIndexState, SegmentInfo, physical_ms
from vchan_assets.query.asof import views_at
from vchan_assets.query.view import collection_segments, collection_views
from vchan_assets.system import System
from vchan_assets.testing.index_data import DIM, Data, ivf_indexed, live_sorted, new_data
from vchan_assets.wal.producer import Producer

LATER = 2 * 86400  # past every tolerance of the defaults


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """GC runs here right after searches: a search's pin ends with it (no reuse window,
    VCHAN_READ_PIN_REUSE), else GC keeps the segments dropped shortly before it."""
    return replace(settings, read_pin_reuse=0.0)


def gc(system: System) -> GcReport:
    return GarbageCollector(system, clock=lambda: time.time() + LATER, passes=[collect_indexes]).run()


def served(system: System, data: Data, ts: int | None = None) -> set[int]:
    info = CollectionRegistry(system.store).get(data.info.id)
    views = collection_views(system.store, info) if ts is None else views_at(system.store, info, ts)[1]
    return {s.id for v in views for s in v.flushed}


def compacted(system: System, data: Data) -> SegmentInfo:
    """The collection's sorted segments mix-compacted into one; returns it."""
    info = CollectionRegistry(system.store).get(data.info.id)
    [plan] = CompactionTrigger(system).trigger(info, CompactionType.MIX, manual=True)
    CompactionExecutor(system, "local").run_pending([plan.plan_id])
    [child] = live_sorted(system, data.info)
    return child


def test_a_mix_output_replaces_its_indexed_inputs_only_once_its_own_index_is_built(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500, 1300], build=True)
    parents = {d.model.segment_id: d.model for d in list_builds(system.store, data.info.id)}
    child = compacted(system, data)
    assert set(child.compaction_from) == set(parents) and child.ready_ts == 0

    assert served(system, data) == set(parents), "not indexed yet: its inputs are served"
    before = now_ts(system.store)
    queries = np.random.default_rng(3).normal(0.0, 4.0, (5, DIM)).astype(np.float32)
    through_parents = Catalog(system).search(data.info.name, queries, k=5)
    waiting = gc(system)
    assert not set(waiting.dropped_segments) & set(parents), "the inputs' meta stays"
    inputs = [s for s in collection_segments(system.store, data.info.id) if s.id in parents]
    assert len(inputs) == 2 and all(system.storage.exists(b.path) for s in inputs for b in s.binlog_files)
    assert not waiting.index_files
    assert all(system.storage.exists(b.files[0]) for b in parents.values())

    index_step(system, "local")  # the output's build; its commit stamps ready_ts

    [built] = [d.model for d in list_builds(system.store, data.info.id) if d.model.segment_id == child.id]
    [child] = live_sorted(system, data.info)
    assert built.state is SegmentIndexState.FINISHED and child.ready_ts > before
    assert served(system, data) == {child.id}
    assert served(system, data, before) == set(parents), "a read in the past serves what it served then"
    assert served(system, data, child.ready_ts) == {child.id}
    through_child = Catalog(system).search(data.info.name, queries, k=5)
    assert sorted(through_child["pk"]) == sorted(through_parents["pk"])

    # Dropped long enough, but ready within the time-travel window: a read at a time before
    # ready_ts still serves the inputs, so they stay.
    window = max(system.settings.gc_drop_tolerance, system.settings.time_travel)
    ready_at = physical_ms(child.ready_ts) / 1000
    held = GarbageCollector(system, clock=lambda: ready_at + window - 0.05, passes=[collect_indexes]).run()
    assert not set(held.dropped_segments) & set(parents)
    collected = gc(system)
    assert set(parents) <= set(collected.dropped_segments)
    assert sorted(collected.index_builds) == sorted(b.build_id for b in parents.values())
    assert not any(system.storage.exists(b.files[0]) for b in parents.values())


def test_an_output_whose_build_fails_or_waits_too_long_replaces_its_inputs_without_it(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500, 1300], build=True)
    parents = {d.model.segment_id for d in list_builds(system.store, data.info.id)}
    child = compacted(system, data)
    settings = system.settings

    assert release_waiting_outputs(system.store, data.info.id, settings.index_handoff_timeout) == []
    assert served(system, data) == parents
    assert release_waiting_outputs(system.store, data.info.id, 0.001) == [child.id], "waited too long"
    assert served(system, data) == {child.id}

    # Another output whose vectors cannot be read: its build fails, and it is released.
    data2 = new_data(producer)
    ivf_indexed(system, producer, data2, [1500, 1300], build=True)
    child2 = compacted(system, data2)
    field_id = data2.info.schema.field("vec").field_id
    for b in next(g for g in child2.binlogs if field_id in g.field_ids).logs:
        system.storage.delete(b.path)
    index_step(system, "local")
    [failed] = [d.model for d in list_builds(system.store, data2.info.id) if d.model.segment_id == child2.id]
    assert failed.state is SegmentIndexState.FAILED
    [child2] = live_sorted(system, data2.info)
    assert child2.ready_ts and served(system, data2) == {child2.id}


def test_an_output_made_before_the_index_was_created_does_not_wait(
    system: System, producer: Producer, data: Data
) -> None:
    ivf_indexed(system, producer, data, [1500, 1300])
    store = system.store
    [d] = list_indexes(store, data.info.id)
    store.put(d.kv.key, replace(d.model, created_at=time.time() + 3600))  # as if created after it
    child = compacted(system, data)

    assert served(system, data) == {child.id} and child.ready_ts == 0
