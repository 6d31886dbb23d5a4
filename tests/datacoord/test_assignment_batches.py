"""A reconcile step writes its assignments many channels per etcd transaction; a batch
that meets a concurrent writer is written again one channel at a time."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.channel_manager import ASSIGN_BATCH, ChannelManager
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, NodeSession, VchannelInfo, WatchState
from vchan_assets.testing.harness import create_collections, fast_settings, watches


@pytest.fixture
def node_ids(store: MetaStore) -> Iterator[list[int]]:
    """Three live DataNode sessions (no node loop: the test answers for them, or not)."""
    ids = [7301, 7302, 7303]
    sessions = [
        Session.for_datanode(store, NodeSession(n, "", "test", time.time(), "HEALTHY"), ttl=30).register()
        for n in ids
    ]
    yield ids
    for s in sessions:
        s.close()


def test_a_cold_start_assigns_more_channels_than_one_batch_in_one_step_each_with_its_own_lease(
    store: MetaStore, settings: Settings, node_ids: list[int]
) -> None:
    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=ASSIGN_BATCH // 4 + 3, shards=4)
    channels = sorted(v for info in infos for v in info.vchannels)
    assert len(channels) > ASSIGN_BATCH
    report = ChannelManager(store, settings).reconcile()
    assert sorted(v for v, _ in report.assigned) == channels and report.conflicts == 0
    found, leases = watches(store)
    for vchannel in channels:
        (watch,) = found[vchannel]
        lease = leases[vchannel]
        assert watch.state is WatchState.TO_WATCH
        assert (watch.lease_id, watch.node_id) == (lease.lease_id, lease.node_id)
    assert len({lease.lease_id for lease in leases.values()}) == len(channels)
    per_node = [sum(1 for _, n in report.assigned if n == node) for node in node_ids]
    assert max(per_node) - min(per_node) <= 1  # balanced while batching


class ConcurrentWriter(IdAllocator):
    """A real allocator; when the step allocates its first lease id (after it read the
    cluster), another coordinator writes a ToWatch for `vchannel` on `node_id`, as a
    coordinator that lost its leadership mid-step might."""

    def __init__(self, store: MetaStore, node_id: int, vchannel: str, collection_id: int) -> None:
        super().__init__(store)
        self.watch_key = store.keys.channel_watch(node_id, vchannel)
        now = time.time()
        self.info = ChannelWatchInfo(
            VchannelInfo(collection_id, vchannel), WatchState.TO_WATCH, now, now + 600
        )
        self.done = False

    def alloc(self, count: int = 1) -> int:
        if not self.done:
            self.done = True
            self.store.put(self.watch_key, self.info)
        return super().alloc(count)


def test_a_batch_that_meets_a_concurrent_writer_assigns_the_others_and_grants_that_channel_no_lease(
    store: MetaStore, settings: Settings, node_ids: list[int]
) -> None:
    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=4)
    channels = sorted(infos[0].vchannels)
    # The channels go to the nodes in order (least loaded, then lowest id): the fourth to the first node.
    taken = channels[3]
    writer = ConcurrentWriter(store, node_ids[0], taken, infos[0].id)
    report = ChannelManager(store, settings, ids=writer).reconcile()
    assert writer.done
    assert sorted(v for v, _ in report.assigned) == channels[:3] and report.conflicts == 1
    found, leases = watches(store)
    assert taken not in leases  # a ToWatch that could not be written granted no lease
    assert [(w.node_id, w.lease_id) for w in found[taken]] == [(node_ids[0], None)]  # the other writer's
    for vchannel in channels[:3]:
        (watch,) = found[vchannel]
        assert watch.lease_id == leases[vchannel].lease_id
