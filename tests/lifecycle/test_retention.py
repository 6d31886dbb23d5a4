"""After log retention deleted a vchannel's oldest log files, everything that reads the
log still works on what is left: the sync checks compare the range the retained log can
prove (and say so), readers listing the log while a retention pass deletes files carry
on. Real etcd, real files, real GC passes."""

from __future__ import annotations

from dataclasses import dataclass, field

from vchan_assets.datanode.checks import check_log_rows
from vchan_assets.lifecycle.plans import CompactionPlan, CompactionType
from vchan_assets.lifecycle.step import lifecycle_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.steps import (
    assert_lifecycle_invariants,
    compact_all,
    flushed_batches,
    live,
    live_l1,
    retain,
)
from vchan_assets.wal.producer import Producer
from vchan_assets.wal.reader import WalReader


def list_plans_of(store: MetaStore, plan_ids: list[int]) -> list[CompactionPlan]:
    found = [store.get_model(store.keys.compaction_plan(p), CompactionPlan) for p in plan_ids]
    return [d.model for d in found if d is not None]


def test_log_rows_check_after_retention_compares_the_retained_range_and_says_so(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3)
    compact_all(system, collection)  # one segment with rows below and above the floor
    [vchannel] = collection.vchannels
    assert check_log_rows(store, storage, collection, vchannel).passed
    retain(system)
    floor = WalReader(storage, vchannel, collection).files()[0].first_offset
    outcome = check_log_rows(store, storage, collection, vchannel)
    assert outcome.passed, outcome.description
    assert outcome.metadata["retained_from_offset"] == floor > 0
    assert f"[{floor}," in outcome.description and "retention" in outcome.description
    # and the next rounds are checked the same way
    more = flushed_batches(system, producer, collection, batches=2, first_batch=3)
    retain(system)
    outcome = check_log_rows(store, storage, collection, vchannel)
    assert outcome.passed, outcome.description
    produced.rows += more.rows
    produced.deleted += more.deleted
    assert_lifecycle_invariants(system, collection, produced)


def test_log_rows_check_after_retention_still_catches_rows_lost_above_the_floor(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=3)
    retain(system)
    flushed_batches(system, producer, collection, batches=1, first_batch=3)
    [vchannel] = collection.vchannels
    assert check_log_rows(store, storage, collection, vchannel).passed
    # lose the newest segment's rows (as a bad commit would): the check must see it
    newest = max(live_l1(store, collection), key=lambda s: s.id)
    key = store.keys.segment(newest.collection_id, newest.partition_id, newest.id)
    found = store.get_model(key, SegmentInfo)
    assert found is not None and newest.level is SegmentLevel.L1
    store.cas(key, found.kv.version, newest.with_changes(state=SegmentState.DROPPED))
    outcome = check_log_rows(store, storage, collection, vchannel)
    assert not outcome.passed, outcome.description


@dataclass(frozen=True)
class RetentionDuringListing(Storage):
    """The real storage, where a retention pass deletes `doomed` log files right after a
    reader listed the log (the window a concurrent GC pass can hit)."""

    doomed: list[str] = field(default_factory=list)

    def list_keys(self, prefix: str, start_after: str | None = None) -> list[str]:
        found = super().list_keys(prefix, start_after)
        while self.doomed:
            self.delete(self.doomed.pop())
        return found


def test_a_reader_listing_the_log_while_retention_deletes_its_oldest_file_carries_on(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=3)
    [vchannel] = collection.vchannels
    before = WalReader(storage, vchannel, collection).files()
    racing = RetentionDuringListing(storage.uri, doomed=[before[0].key])
    assert WalReader(racing, vchannel, collection).files() == before[1:]
    racing = RetentionDuringListing(storage.uri, doomed=[before[1].key])
    outcome = check_log_rows(store, racing, collection, vchannel)
    assert outcome.passed, outcome.description
    assert outcome.metadata["retained_from_offset"] == before[2].first_offset


def test_log_rows_check_passes_once_compaction_applied_the_deletes_an_l0_compaction_moved(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3)
    [vchannel] = collection.vchannels
    report = lifecycle_step(system, engine="local", collect=False)
    assert {p.type for p in list_plans_of(store, report.planned)} >= {CompactionType.L0, CompactionType.MIX}
    assert not any(s.deltalogs for s in live(store, collection)), "every delete applied and gone"
    outcome = check_log_rows(store, storage, collection, vchannel)
    assert outcome.passed, outcome.description
    assert outcome.metadata["lost_deletes"] == 0 and outcome.metadata["lost_rows"] == 0
    assert_lifecycle_invariants(system, collection, produced)


def test_log_rows_check_catches_a_delete_that_was_lost(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=2)
    [vchannel] = collection.vchannels
    # drop the L0 segments (their deletes) without applying them: a lost delete
    for seg in [s for s in live(store, collection) if s.level is SegmentLevel.L0]:
        key = store.keys.segment(seg.collection_id, seg.partition_id, seg.id)
        found = store.get_model(key, SegmentInfo)
        assert found is not None
        store.cas(key, found.kv.version, seg.with_changes(state=SegmentState.DROPPED))
    outcome = check_log_rows(store, storage, collection, vchannel)
    assert not outcome.passed and outcome.metadata["lost_deletes"] == 20, outcome.description


def test_a_reader_with_cached_footers_sees_no_gap_when_retention_deletes_files_as_it_lists(
    system: System, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    [vchannel] = collection.vchannels
    racing = RetentionDuringListing(storage.uri)
    reader = WalReader(racing, vchannel, collection)
    flushed_batches(system, producer, collection, batches=1)
    cached = reader.files()  # these footers are cached, the next files' are not
    flushed_batches(system, producer, collection, batches=2, first_batch=1)
    every = WalReader(storage, vchannel, collection).files()
    # a pass deletes the oldest files, up to one the reader has not described yet
    doomed = every[: len(cached) + 1]
    racing.doomed.extend(reversed([f.key for f in doomed]))
    assert reader.files() == every[len(doomed) :]
