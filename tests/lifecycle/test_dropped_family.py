"""Dropped segments leave the live family (`meta/dropped/...`): a compaction's commit moves
its inputs there in its one transaction (a kill at any step leaves each input in exactly
one family: tests/lifecycle/test_crash.py), reads at a timestamp before the drop still serve
them, GC deletes their files and records after the tolerance, and the Dropped segments a
version before the family left among the live ones keep every row readable until GC moves
them over."""

from __future__ import annotations

import time
from dataclasses import replace

import pyarrow as pa

from vchan_assets.catalog import Catalog
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentState
from vchan_assets.query.asof import now_ts
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.steps import (
    assert_channel_index_complete,
    assert_lifecycle_invariants,
    compact_all,
    expected_pks,
    flushed_batches,
)
from vchan_assets.wal.producer import Producer


def families(store: MetaStore, seg: SegmentInfo) -> tuple[bool, bool]:
    """(in the live family, in the dropped family)."""
    door = SegmentMeta(store)
    return store.get(door.key(seg)) is not None, store.get(door.dropped_key(seg)) is not None


def dropped_of(store: MetaStore, info: CollectionInfo) -> list[SegmentInfo]:
    return [s for s in segments(store, info) if s.state is SegmentState.DROPPED]


def as_an_older_version_left_them(store: MetaStore, dropped: list[SegmentInfo]) -> None:
    """Each dropped record put back at its live key with its index entry: what the version
    before the dropped family wrote."""
    door = SegmentMeta(store)
    for seg in dropped:
        assert store.txn({}, door.create_puts(seg), [door.dropped_key(seg)]) is not None


def pks(system: System, info: CollectionInfo, as_of: int | None = None) -> list[int]:
    rows = Catalog(system).read_collection(info.name, as_arrow=True, with_vectors=False, as_of=as_of)
    assert isinstance(rows, pa.Table)
    return sorted(rows["pk"].to_pylist())


def test_a_compaction_moves_its_inputs_out_of_the_live_family_in_its_commit(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3, deletes=4)
    live_before = len(SegmentMeta(store).list(collection.id))

    compact_all(system, collection)

    dropped = dropped_of(store, collection)
    assert dropped and all(families(store, s) == (False, True) for s in dropped)
    live = SegmentMeta(store).list(collection.id)
    assert all(d.model.state is not SegmentState.DROPPED for d in live)
    assert len(live) < live_before  # the inputs left, fewer outputs came
    [vchannel] = collection.vchannels
    assert {d.model.id for d in SegmentMeta(store).list(collection.id, vchannel=vchannel)} == {
        d.model.id for d in live
    }
    assert_channel_index_complete(store)
    assert_lifecycle_invariants(system, collection, produced)


def test_a_read_at_a_timestamp_before_the_drop_serves_the_dropped_inputs(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    travel = replace(system, settings=replace(system.settings, time_travel=600.0))
    produced = flushed_batches(travel, producer, collection, batches=2, deletes=5)
    before = now_ts(store)

    for kind in (CompactionType.L0, CompactionType.MIX):  # deletes applied, then merged away
        assert CompactionTrigger(travel).trigger(collection, kind, manual=True)
        assert all(o.state is PlanState.COMPLETED for o in CompactionExecutor(travel, "local").run_pending())

    assert dropped_of(store, collection) and all(
        families(store, s) == (False, True) for s in dropped_of(store, collection)
    )
    assert pks(travel, collection, as_of=before) == pks(travel, collection) == expected_pks(produced)


def test_gc_deletes_the_dropped_records_and_their_files_after_the_tolerance(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    compacted = time.time()
    compact_all(system, collection)
    dropped = [s for s in dropped_of(store, collection) if s.binlogs]
    assert dropped
    tolerant = replace(system, settings=replace(system.settings, gc_drop_tolerance=5.0))

    assert GarbageCollector(tolerant, clock=lambda: compacted).run().dropped_segments == []
    assert all(families(store, s) == (False, True) for s in dropped)
    report = GarbageCollector(tolerant, clock=lambda: time.time() + 10).run()

    assert {s.id for s in dropped} <= set(report.dropped_segments)
    assert all(families(store, s) == (False, False) for s in dropped)
    assert not any(system.storage.exists(p) for s in dropped for p in s.file_paths)
    assert store.list_prefix(SegmentMeta(store).dropped_prefix(collection.id)).items == []
    assert_lifecycle_invariants(system, collection, produced)


def test_dropped_segments_an_older_version_left_live_keep_every_row_then_are_moved_and_collected(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2, deletes=4)
    compact_all(system, collection)
    dropped = dropped_of(store, collection)
    as_an_older_version_left_them(store, dropped)
    assert all(families(store, s) == (True, False) for s in dropped)

    # read as they are: live listings leave them out, reads and the next sync keep every row
    assert all(d.model.state is not SegmentState.DROPPED for d in SegmentMeta(store).list(collection.id))
    more = flushed_batches(system, producer, collection, batches=1, first_batch=5)
    produced.rows += more.rows
    produced.deleted += more.deleted
    assert_lifecycle_invariants(system, collection, produced)

    # GC moves them before the tolerance, then deletes them after it
    tolerant = replace(system, settings=replace(system.settings, gc_drop_tolerance=5.0))
    assert GarbageCollector(tolerant, clock=time.time).run().dropped_segments == []
    assert all(families(store, s) == (False, True) for s in dropped)
    assert_channel_index_complete(store)
    assert_lifecycle_invariants(system, collection, produced)
    report = GarbageCollector(tolerant, clock=lambda: time.time() + 10).run()
    assert {s.id for s in dropped if s.binlogs} <= set(report.dropped_segments)
    assert_lifecycle_invariants(system, collection, produced)
