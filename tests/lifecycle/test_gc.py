"""Garbage collection: orphans after the missing tolerance, dropped segments after the
drop tolerance and the checkpoint, log retention, pause/resume, dry run; never a file
named by live meta, never a file younger than the tolerance. Real etcd and files."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.lifecycle.plans import CompactionType, PlanState, list_plans
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.steps import assert_lifecycle_invariants, compact_all, flushed_batches, live
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader
from vchan_assets.wal.writer import WalWriter

LATER = 10.0  # seconds "from now" for a clock past every tolerance used here


def collector(system: System, ahead: float = 0.0, at: float | None = None) -> GarbageCollector:
    """A collector with 5 s tolerances whose clock runs `ahead` of now, or stands still
    `at` a moment (taken before the files were written: they are younger whatever the load)."""
    tolerant = replace(system.settings, gc_missing_tolerance=5.0, gc_drop_tolerance=5.0, wal_retention=5.0)
    clock = (lambda: at) if at is not None else (lambda: time.time() + ahead)
    return GarbageCollector(replace(system, settings=tolerant), clock=clock)


def test_orphan_is_deleted_only_once_older_than_the_missing_tolerance(
    system: System, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=1)
    orphan = f"insert_log/{collection.id}/1/424242/0/1.parquet"
    written = time.time()
    storage.write_atomic(orphan, b"left by a crashed sync")
    assert collector(system, at=written).run().orphans == []  # younger than the tolerance
    report = collector(system, ahead=LATER).run()
    assert report.orphans == [orphan] and not storage.exists(orphan)
    assert_lifecycle_invariants(system, collection, produced)


def test_dropped_segments_files_then_meta_go_after_the_drop_tolerance_and_the_checkpoint(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    compacted = time.time()
    compact_all(system, collection)
    dropped = [s for s in segments(store, collection) if s.state is SegmentState.DROPPED and s.binlogs]
    assert dropped
    assert collector(system, at=compacted).run().dropped_segments == []  # dropped just now
    report = collector(system, ahead=LATER).run()
    assert {s.id for s in dropped} <= set(report.dropped_segments)
    assert all(not storage.exists(p) for s in dropped for p in s.file_paths)
    assert not {s.id for s in dropped} & {s.id for s in segments(store, collection)}
    assert_lifecycle_invariants(system, collection, produced)


def test_dropped_segment_beyond_the_checkpoint_is_kept(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=1)
    [seg] = [s for s in live(store, collection) if s.binlogs]
    key = store.keys.segment(seg.collection_id, seg.partition_id, seg.id)
    found = store.get_model(key, type(seg))
    assert found is not None and seg.dml_position is not None
    ahead = replace(seg.dml_position, offset=seg.dml_position.offset + 1000)
    store.cas(
        key,
        found.kv.version,
        seg.with_changes(state=SegmentState.DROPPED, dropped_at=1.0, dml_position=ahead),
    )
    report = collector(system, ahead=LATER).run()
    assert seg.id not in report.dropped_segments
    assert all(storage.exists(p) for p in seg.file_paths)


def test_gc_never_deletes_a_file_named_by_live_meta_nor_one_a_running_plan_reserved(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    [plan] = CompactionTrigger(system).trigger(collection, CompactionType.MIX)
    ex = CompactionExecutor(system, "local")
    started = ex.start(list_plans(store)[-1])
    assert isinstance(started, tuple)
    [result] = ex._run([started[1]])  # outputs written, not committed: a GC pass now
    report = collector(system, ahead=LATER).run()
    assert not any(f"/{plan.output_ids[0]}/" in k for k in report.orphans)
    assert ex.finish(started[0], result).state is PlanState.COMPLETED
    assert_lifecycle_invariants(system, collection, produced)


def test_paused_gc_does_nothing_until_resumed_and_dry_run_deletes_nothing(
    system: System, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=1)
    orphan = f"delta_log/{collection.id}/1/434343/1.parquet"
    storage.write_atomic(orphan, b"x")
    gc = collector(system, ahead=LATER)
    gc.pause(3600)
    assert gc.run().paused_until > 0 and storage.exists(orphan)
    gc.resume()
    dry = gc.run(dry_run=True)
    assert orphan in dry.orphans and storage.exists(orphan)
    assert orphan in gc.run().orphans and not storage.exists(orphan)


def test_log_files_wholly_below_the_checkpoint_are_retained_then_deleted_with_their_data_files(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    started = time.time()
    produced = flushed_batches(system, producer, collection, batches=3)
    [vchannel] = collection.vchannels
    files = WalReader(storage, vchannel, collection).files()
    assert len(files) > 2
    # what a producer killed after writing its data file, before publishing, leaves
    rows = generate_rows(collection.schema, 5, start_pk=10**6)
    orphan = WalWriter(storage, vchannel, collection).write_data(rows, uuid.uuid4().hex)
    assert collector(system, at=started).run().wal_files == []  # younger than the retention
    report = collector(system, ahead=LATER).run()
    assert report.wal_files
    assert orphan.key in report.wal_files and not storage.exists(orphan.key)
    left = WalReader(storage, vchannel, collection).files()
    assert left and left[-1] == files[-1], "the newest file stays"
    checkpoint = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    assert checkpoint is not None
    gone = [f for f in files if f.key in report.wal_files]
    assert all(f.last_offset < checkpoint.model.offset for f in gone)
    data = [f.data_key for f in gone if f.data_key]
    assert data and all(k in report.wal_files and not storage.exists(k) for k in data), "with their data"
    assert left[0].first_offset <= checkpoint.model.offset, "the checkpoint position stays readable"
    # a new round syncs from the checkpoint as before
    more = flushed_batches(system, producer, collection, batches=1, first_batch=3)
    produced.rows += more.rows
    produced.deleted += more.deleted
    assert_lifecycle_invariants(system, collection, produced)
