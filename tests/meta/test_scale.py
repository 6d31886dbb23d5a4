"""Segment meta past gRPC's 4 MiB receive limit: listed in pages at one revision, so the
door, `vchan status` and a sync work on a collection of thousands of segments."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta import store as store_module
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, SegmentState
from vchan_assets.status import SegmentDetail, collect_status
from vchan_assets.system import System
from vchan_assets.testing.harness import Produced, produce
from vchan_assets.testing.steps import flushed_segment, write_segments
from vchan_assets.wal.producer import Producer

SEGMENTS = 3000  # about 1.9 KB of meta each: 5.6 MB, over gRPC's 4 MiB receive limit
RECEIVE_LIMIT = 4 * 1024 * 1024


@pytest.fixture
def crowded(store: MetaStore, collection: CollectionInfo) -> Iterator[CollectionInfo]:
    """`collection` with SEGMENTS flushed segments on its second vchannel: more segment
    meta than one etcd response may carry."""
    assert write_segments(store, collection, collection.vchannels[1], SEGMENTS) > RECEIVE_LIMIT
    yield collection


def test_door_lists_a_collection_over_the_receive_limit_whole_at_one_revision(
    store: MetaStore, crowded: CollectionInfo
) -> None:
    revision = store.revision()
    found = SegmentMeta(store).list(crowded.id)
    assert len(found) == SEGMENTS
    assert [d.kv.key for d in found] == sorted(d.kv.key for d in found)
    assert max(d.kv.mod_revision for d in found) <= revision
    assert sum(len(d.kv.value) for d in found) > RECEIVE_LIMIT


def test_door_filters_by_vchannel_partition_and_state(store: MetaStore, crowded: CollectionInfo) -> None:
    door = SegmentMeta(store)
    first, second = crowded.vchannels
    assert door.list(crowded.id, vchannel=first) == []
    assert len(door.list(crowded.id, vchannel=second, states={SegmentState.FLUSHED})) == SEGMENTS
    assert door.list(crowded.id, states={SegmentState.GROWING}) == []
    assert len(door.list(crowded.id, partition=crowded.partitions[0])) == SEGMENTS


def test_status_of_a_collection_over_the_receive_limit_counts_every_segment(
    system: System, crowded: CollectionInfo
) -> None:
    report = collect_status(Catalog(system), segments=SegmentDetail())
    flushed = [r for r in report["segments"] if r["state"] == SegmentState.FLUSHED.value]
    assert sum(r["segments"] for r in flushed) == SEGMENTS


def test_sync_of_a_vchannel_of_a_collection_over_the_receive_limit_commits_its_rows(
    system: System, store: MetaStore, producer: Producer, crowded: CollectionInfo
) -> None:
    vchannel = crowded.vchannels[0]
    produce(producer, crowded.name, Produced(), 200, start_pk=0)
    lease = grant_channel_lease(store, IdAllocator(store), vchannel, node_id=1)
    started = time.monotonic()
    SyncTask(system, crowded, vchannel, lease, engine="local").run()
    mine = SegmentMeta(store).list(crowded.id, vchannel=vchannel)
    assert mine and sum(d.model.num_rows for d in mine) > 0
    head = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    assert head is not None and head.model.offset >= 0
    assert time.monotonic() - started < 30


def test_a_key_written_between_pages_is_not_in_the_listing(
    store: MetaStore, collection: CollectionInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "PAGE_KEYS", 10)
    write_segments(store, collection, collection.vchannels[0], 35)
    late = flushed_segment(collection, collection.vchannels[0], 99_999_999)  # sorts after every other
    pages = []
    get_range = store.client.get_range_response

    def page_then_write(*args: object, **kwargs: object) -> object:
        pages.append(kwargs["revision"])
        page = get_range(*args, **kwargs)
        if len(pages) == 1:
            store.put(SegmentMeta(store).key(late), late)
        return page

    monkeypatch.setattr(store.client, "get_range_response", page_then_write)
    found = SegmentMeta(store).list(collection.id)
    assert len(found) == 35 and late.id not in {d.model.id for d in found}
    assert len(pages) == 4 and pages[0] is None and len(set(pages[1:])) == 1
