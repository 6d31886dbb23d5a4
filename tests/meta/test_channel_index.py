"""The per-vchannel segment index (`meta/channel-segment/...`): a vchannel's segments are
read without reading its collection's, every site that creates or deletes a segment key
keeps the index, and a stack written before the index is backfilled, killed or not."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datacoord.recovery import channel_segments
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import Produced, cli_env, produce
from vchan_assets.testing.steps import (
    assert_channel_index_complete,
    assert_exactly_once,
    assert_lifecycle_invariants,
    compact_all,
    flushed_batches,
    new_collection,
    reads,
    sync_all,
    write_segments,
)
from vchan_assets.wal.producer import Producer

CROWD = 2000  # segments of the other vchannel: about 3.8 MB of meta

BACKFILL_CHILD = """
from vchan_assets.config import Settings
from vchan_assets.meta import segments
from vchan_assets.meta.store import MetaStore
segments.BACKFILL_BATCH = 10
segments.SegmentMeta(MetaStore.connect(Settings.from_env())).backfill_channel_index()
"""


def as_before_the_index(store: MetaStore) -> None:
    """The stack as a version before the index left it: segment keys, no entries, no mark."""
    store.delete_prefix(store.keys.channel_segment.prefix)
    store.delete(store.keys.channel_segment_index())


def ids(store: MetaStore, info: CollectionInfo, vchannel: str) -> list[int]:
    return [d.model.id for d in SegmentMeta(store).list(info.id, vchannel=vchannel)]


def filtered(store: MetaStore, info: CollectionInfo, vchannel: str) -> list[int]:
    """The vchannel's segments as the collection's listing holds them."""
    return [d.model.id for d in SegmentMeta(store).list(info.id) if d.model.vchannel == vchannel]


def test_a_vchannel_listing_reads_its_own_segments_not_its_collections(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    mine, crowded = collection.vchannels
    produced = Produced()
    produce(producer, collection.name, produced, 200, start_pk=0)
    producer.flush(collection.name)
    sync_all(system, collection)
    crowd_bytes = write_segments(store, collection, crowded, CROWD)
    own = SegmentMeta(store).list(collection.id, vchannel=mine)
    assert own and len(own) == len(filtered(store, collection, mine))

    keys, size = reads(store, lambda: SegmentMeta(store).list(collection.id, vchannel=mine))
    # the mark, the vchannel's index entries (keys only) and its segments: nothing of the crowd
    assert keys == 1 + 2 * len(own)
    assert size < sum(len(d.kv.value) + 200 for d in own) + 200 < crowd_bytes / 100

    produce(producer, collection.name, produced, 100, start_pk=10_000)
    lease = store.read_lease(mine)
    assert lease is not None
    keys, _ = reads(store, lambda: SyncTask(system, collection, mine, lease, engine="local").run())
    assert keys < CROWD / 10, f"a sync of {mine} read {keys} keys"
    assert len(SegmentMeta(store).list(collection.id, vchannel=crowded)) >= CROWD


def test_a_listing_through_the_index_is_the_collections_listing_of_that_vchannel(
    system: System, store: MetaStore, producer: Producer
) -> None:
    info = new_collection(producer, channels=3)
    flushed_batches(system, producer, info, batches=2, rows=50, deletes=5)
    for vchannel in info.vchannels:
        through_index = SegmentMeta(store).list(info.id, vchannel=vchannel)
        listed = [d for d in SegmentMeta(store).list(info.id) if d.model.vchannel == vchannel]
        assert through_index == listed and listed
        partition = info.partitions[0]
        assert SegmentMeta(store).list(info.id, vchannel=vchannel, partition=partition) == [
            d for d in listed if d.model.partition_id == partition
        ]
        flushed = {SegmentState.FLUSHED}
        assert SegmentMeta(store).list(info.id, vchannel=vchannel, states=flushed) == [
            d for d in listed if d.model.state is SegmentState.FLUSHED
        ]


def test_an_entry_whose_segment_is_gone_is_skipped(store: MetaStore, collection: CollectionInfo) -> None:
    vchannel = collection.vchannels[0]
    write_segments(store, collection, vchannel, 3, first=500)
    door = SegmentMeta(store)
    gone = door.list(collection.id, vchannel=vchannel)[1]
    store.delete(gone.kv.key)  # as a version before the index deleted segments: the entry stays
    assert ids(store, collection, vchannel) == [500, 502]


def test_a_stack_written_before_the_index_is_listed_by_collection_until_backfilled_then_syncs_once(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2, rows=100, deletes=5)
    before = {v: filtered(store, collection, v) for v in collection.vchannels}
    as_before_the_index(store)

    assert not SegmentMeta(store).channel_index_ready()
    for vchannel in collection.vchannels:  # read from the collection's listing meanwhile
        assert ids(store, collection, vchannel) == before[vchannel] != []
    added = SegmentMeta(store).backfill_channel_index()

    assert added == sum(map(len, before.values()))
    assert SegmentMeta(store).channel_index_ready()
    assert_channel_index_complete(store)
    for vchannel in collection.vchannels:
        assert ids(store, collection, vchannel) == before[vchannel]
    produce(producer, collection.name, produced, 150, start_pk=90_000, deletes=3)
    producer.flush(collection.name)
    sync_all(system, collection)
    assert_exactly_once(store, storage, collection, produced)
    assert SegmentMeta(store).backfill_channel_index() == 0


def test_a_backfill_killed_midway_completes_when_run_again_and_writes_no_entry_twice(
    settings: Settings, store: MetaStore, collection: CollectionInfo
) -> None:
    vchannel = collection.vchannels[0]
    write_segments(store, collection, vchannel, 45, indexed=False)
    store.delete(store.keys.channel_segment_index())
    env = cli_env(settings, VCHAN_FAILPOINT="channel_index_backfill")

    killed = subprocess.run([sys.executable, "-c", BACKFILL_CHILD], env=env, capture_output=True, timeout=120)

    assert killed.returncode == -9, killed.stderr.decode()[-2000:]  # after its first transaction
    first = store.list_prefix(store.keys.channel_segment.prefix).items
    assert len(first) == 10 and not SegmentMeta(store).channel_index_ready()
    assert len(ids(store, collection, vchannel)) == 45  # the collection's listing meanwhile
    assert SegmentMeta(store).backfill_channel_index() == 35
    entries = store.list_prefix(store.keys.channel_segment.prefix).items
    assert len(entries) == 45 and {kv.version for kv in entries} == {1}
    assert {kv.key: kv.mod_revision for kv in first}.items() <= {
        kv.key: kv.mod_revision for kv in entries
    }.items()
    assert_channel_index_complete(store)
    assert len(ids(store, collection, vchannel)) == 45


def test_the_datacoord_backfills_a_stack_written_before_the_index_at_its_first_tick(
    settings: Settings, store: MetaStore, collection: CollectionInfo
) -> None:
    write_segments(store, collection, collection.vchannels[1], 30, indexed=False)
    store.delete(store.keys.channel_segment_index())
    coordinator = DataCoordinator(settings, store)
    assert coordinator.election.campaign(timeout=5.0)
    try:
        coordinator.tick()
        assert SegmentMeta(store).channel_index_ready()
        assert_channel_index_complete(store)
    finally:
        coordinator.election.resign()


def test_segments_an_older_version_writes_after_the_mark_are_repaired_by_the_next_meta_reload(
    settings: Settings, store: MetaStore, collection: CollectionInfo
) -> None:
    vchannel = collection.vchannels[0]
    coordinator = DataCoordinator(settings, store, reload_interval=0.0)
    assert coordinator.election.campaign(timeout=5.0)
    try:
        coordinator.tick()
        # a DataNode or producer of the version before the index, during a rolling upgrade
        write_segments(store, collection, vchannel, 5, first=700, indexed=False)
        assert ids(store, collection, vchannel) == []  # the mark is there: not seen yet
        coordinator.tick()
        assert ids(store, collection, vchannel) == [700, 701, 702, 703, 704]
        store.delete(store.keys.segment(collection.id, collection.partitions[0], 701))  # and its GC
        coordinator.tick()
        assert_channel_index_complete(store)
        assert ids(store, collection, vchannel) == [700, 702, 703, 704]
    finally:
        coordinator.election.resign()


def test_allocation_sync_compaction_and_gc_keep_the_index_complete(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3, rows=60, deletes=4)
    assert_channel_index_complete(store)  # allocation (Growing), sync (L0, flush)
    compact_all(system, collection)
    assert_lifecycle_invariants(system, collection, produced)  # compaction outputs
    dropped = [
        d
        for d in SegmentMeta(store).list(collection.id, include_dropped=True)
        if d.model.state is SegmentState.DROPPED
    ]
    assert dropped
    later = replace(system, settings=replace(system.settings, gc_drop_tolerance=0.0))
    report = GarbageCollector(later, clock=lambda: time.time() + 60).run()

    assert {d.model.id for d in dropped} <= set(report.dropped_segments)
    assert_channel_index_complete(store)  # GC deleted each entry with its segment
    for vchannel in collection.vchannels:
        assert not {d.model.id for d in dropped} & set(ids(store, collection, vchannel))
    assert_lifecycle_invariants(system, collection, produced)


def test_an_etcd_of_fewer_operations_a_transaction_backfills_and_lists_in_smaller_batches(
    settings: Settings, tmp_path: Path
) -> None:
    server = EmbeddedEtcd(tmp_path / "small-txn-etcd", max_txn_ops=8).start()
    small = replace(settings, etcd_endpoints=(server.endpoint,))
    store = MetaStore.connect(small)
    try:
        system = System(small, store, Storage.from_settings(small))
        info = new_collection(Producer(system), channels=1)
        vchannel = info.vchannels[0]
        write_segments(store, info, vchannel, 30, indexed=False, batch=8)
        assert SegmentMeta(store).backfill_channel_index() == 30
        assert_channel_index_complete(store)
        assert len(ids(store, info, vchannel)) == 30
    finally:
        store.close()
        server.stop()


def test_a_sync_of_a_channel_granted_anew_lists_only_its_vchannel(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    first, second = collection.vchannels
    write_segments(store, collection, second, 300)
    produce(producer, collection.name, Produced(), 50, start_pk=0)
    lease = grant_channel_lease(store, IdAllocator(store), first, node_id=3)
    SyncTask(system, collection, first, lease, engine="local").run()
    mine = channel_segments(store, collection.id, first)
    assert mine and {d.model.vchannel for d in mine} == {first}
    assert_channel_index_complete(store)


def test_the_reloads_repair_reads_the_segment_keys_it_is_given_and_only_the_entries_beside(
    store: MetaStore, collection: CollectionInfo
) -> None:
    """The DataCoord's reload lists every segment key (keys only) to see whether meta
    changed; its repair of the index reads the entries at that listing's revision instead
    of listing the segment keys a second time."""
    vchannel = collection.vchannels[0]
    write_segments(store, collection, vchannel, 200, first=900)
    write_segments(store, collection, vchannel, 3, first=2_000, indexed=False)  # an older version's
    door = SegmentMeta(store)
    listing = door.segment_keys()
    entries = len(store.list_prefix(store.keys.channel_segment.prefix, keys_only=True).items)
    keys, _ = reads(store, lambda: door.repair_channel_index(listing))
    assert keys == entries + 3, (keys, entries)  # the entries, then the 3 values to index
    assert_channel_index_complete(store)
    assert {2_000, 2_001, 2_002} <= set(ids(store, collection, vchannel))


def test_a_repair_whose_listing_etcd_compacted_meanwhile_reads_both_again(
    private_store: MetaStore, collection: CollectionInfo
) -> None:
    vchannel = collection.vchannels[0]
    write_segments(private_store, collection, vchannel, 4, first=900, indexed=False)
    door = SegmentMeta(private_store)
    listing = door.segment_keys()
    write_segments(private_store, collection, vchannel, 2, first=950, indexed=False)
    private_store.compact(private_store.revision())
    assert door.repair_channel_index(listing) == (6, 0)  # a fresh listing: the later two too
    assert_channel_index_complete(private_store)
