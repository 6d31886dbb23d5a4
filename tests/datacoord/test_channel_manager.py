"""The channel manager's rules and the node's per-event functions, step by step in one
process on a real etcd (the functions a Dagster sensor calls)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.channel_manager import ChannelManager
from vchan_assets.datacoord.watchers import NotWatcherError, lease_for_watcher
from vchan_assets.datanode.channel import NodeContext, sync_once
from vchan_assets.datanode.node import watch_channel
from vchan_assets.meta.codec import encode
from vchan_assets.meta.errors import CasConflictError, LeaseLostError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    ChannelWatchInfo,
    CollectionInfo,
    MsgPosition,
    VchannelInfo,
    WatchState,
)
from vchan_assets.storage import Storage
from vchan_assets.testing.harness import Produced, create_collections, fast_settings, produce
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer

from .helpers import Sessions, answer, node_system

if TYPE_CHECKING:
    from vchan_assets.datanode.node import DataNode


def _watch(store: MetaStore, node_id: int, vchannel: str) -> tuple[ChannelWatchInfo, int] | None:
    found = store.get_model(store.keys.channel_watch(node_id, vchannel), ChannelWatchInfo)
    return None if found is None else (found.model, found.kv.version)


def _wait_watching(node: DataNode, channels: list[str], what: str) -> None:
    wait_until(lambda: node.channels == channels, 10, what, interval=0.05, describe=lambda: node.channels)


@dataclass(frozen=True)
class Assigned:
    """One collection of one vchannel, assigned (ToWatch) to one node by the manager."""

    manager: ChannelManager
    producer: Producer
    collection: CollectionInfo
    vchannel: str
    node_id: int
    key: str
    info: ChannelWatchInfo
    version: int


def _assign_one_channel(
    store: MetaStore, settings: Settings, nodes: Sessions, node_id: int, rows: int = 0
) -> Assigned:
    """A collection of one vchannel (with `rows` inserted and a time tick) assigned to
    node `node_id`, whose ToWatch nobody has answered yet."""
    producer, infos = create_collections(store, settings, count=1, shards=1)
    collection = infos[0]
    if rows:
        produce(producer, collection.name, Produced(), rows, 1)
        producer.time_tick(collection.name)
    manager = ChannelManager(store, settings)
    node = nodes.up(node_id)
    manager.reconcile()
    vchannel = collection.vchannels[0]
    found = _watch(store, node, vchannel)
    assert found is not None
    key = store.keys.channel_watch(node, vchannel)
    return Assigned(manager, producer, collection, vchannel, node, key, *found)


def _rewrite_watch(
    store: MetaStore, node_id: int, vchannel: str, **changes: object
) -> tuple[ChannelWatchInfo, int]:
    """Change a node's watch info as a test needs it; returns it with its new version."""
    found = _watch(store, node_id, vchannel)
    assert found is not None
    store.cas(store.keys.channel_watch(node_id, vchannel), found[1], replace(found[0], **changes))  # type: ignore[arg-type]
    again = _watch(store, node_id, vchannel)
    assert again is not None
    return again


def test_with_no_live_node_channels_wait_as_remaining_and_go_to_the_first_node(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=3)
    manager = ChannelManager(store, settings)
    report = manager.reconcile()
    assert sorted(report.remaining) == sorted(infos[0].vchannels)
    assert len(store.list_prefix(store.keys.remaining_channel.prefix).items) == 3
    node = nodes.up(7001)
    report = manager.reconcile()
    assert sorted(v for v, _ in report.assigned) == sorted(infos[0].vchannels)
    assert {n for _, n in report.assigned} == {node}
    assert store.list_prefix(store.keys.remaining_channel.prefix).items == []
    for vchannel in infos[0].vchannels:
        found = _watch(store, node, vchannel)
        assert found is not None
        info = found[0]
        lease = store.read_lease(vchannel)
        assert info.state is WatchState.TO_WATCH and lease is not None and info.lease_id == lease.lease_id


def test_a_dead_nodes_channels_are_reassigned_with_new_lease_ids(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=2)
    manager = ChannelManager(store, settings)
    a = nodes.up(7101)
    manager.reconcile()
    answer(store, settings, a)
    old = {v: store.read_lease(v) for v in infos[0].vchannels}
    b = nodes.up(7102)
    nodes.down(a)
    report = manager.reconcile()
    assert {n for _, n in report.assigned} == {b}
    assert {why for *_, why in report.removed} == {"node session is gone"}
    for vchannel in infos[0].vchannels:
        new = store.read_lease(vchannel)
        before = old[vchannel]
        assert new is not None and before is not None and new.lease_id != before.lease_id and new.node_id == b
        assert _watch(store, a, vchannel) is None


def test_to_watch_stuck_past_the_timeout_or_watch_failure_is_reassigned(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = replace(fast_settings(settings), watch_timeout=5)
    _, infos = create_collections(store, settings, count=1, shards=2)
    v0, v1 = infos[0].vchannels
    manager = ChannelManager(store, settings)
    a = nodes.up(7201)
    manager.reconcile()
    b = nodes.up(7202)
    # v0: node a never answers; v1: node a answers WatchFailure.
    found = _watch(store, a, v1)
    assert found is not None
    store.cas(
        store.keys.channel_watch(a, v1),
        found[1],
        replace(found[0], state=WatchState.WATCH_FAILURE, reason="test"),
    )
    report = manager.reconcile()
    assert (v1, b) in report.assigned and (v0, b) not in report.assigned
    report = manager.reconcile(now=time.time() + 6)
    assert (v0, b) in report.assigned
    assert any("stuck past the watch timeout" in why for *_, why in report.removed)


def test_a_move_releases_first_and_watches_after_release_success(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=4)
    manager = ChannelManager(store, settings)
    a = nodes.up(7301)
    manager.reconcile()
    answer(store, settings, a)
    b = nodes.up(7302)
    report = manager.reconcile()
    assert len(report.releasing) == 2 and not report.assigned
    moving = [v for v, _, _ in report.releasing]
    # Until node a answers, node b gets nothing: never two watchers.
    assert not manager.reconcile().assigned
    answer(store, settings, a)
    report = manager.reconcile()
    assert sorted(report.assigned) == sorted((v, b) for v in moving)
    answer(store, settings, b)
    assert sorted(n for es in manager.assignments().values() for n, _ in es) == [a, a, b, b]


def test_with_auto_balance_off_a_new_node_gets_no_channel_but_a_dead_nodes_channels_still_move(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = replace(fast_settings(settings), auto_balance=False)
    _, infos = create_collections(store, settings, count=1, shards=4)
    manager = ChannelManager(store, settings)
    a = nodes.up(7311)
    manager.reconcile()
    answer(store, settings, a)
    b = nodes.up(7312)

    report = manager.reconcile()

    assert not report.releasing and not report.assigned
    nodes.down(a)
    report = manager.reconcile()
    assert sorted(report.assigned) == sorted((v, b) for v in infos[0].vchannels)


def test_watch_with_a_replaced_lease_answers_watch_failure(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    one = _assign_one_channel(store, settings, nodes, 7401)
    store.put(store.keys.channel_lease(one.vchannel), {"lease_id": 1, "node_id": 99, "granted_at": 0.0})
    ctx = NodeContext(node_system(store, settings), one.node_id)
    result = watch_channel(ctx, one.key, one.version, one.info)
    assert result.state is WatchState.WATCH_FAILURE and "not current" in result.reason
    # A stale version (the coordinator moved on) is a conflict, not a silent overwrite.
    with pytest.raises(CasConflictError):
        watch_channel(ctx, one.key, one.version, one.info)


def test_a_watch_info_without_lease_id_commits_through_the_datacoord_watcher_check(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    one = _assign_one_channel(store, settings, nodes, 7501)
    producer, info, vchannel, a, key = one.producer, one.collection, one.vchannel, one.node_id, one.key
    # An older coordinator's watch info: no lease id.
    found = _rewrite_watch(store, a, vchannel, lease_id=None)
    ctx = NodeContext(node_system(store, settings), a)
    assert watch_channel(ctx, key, found[1], found[0]).state is WatchState.WATCH_SUCCESS
    produced = Produced()
    produce(producer, info.name, produced, 300, 1, deletes=4)
    producer.time_tick(info.name)
    result = sync_once(ctx, info, vchannel, lease=None, force=True)
    assert result is not None and result.rows == 300
    assert_exactly_once(store, Storage.from_settings(settings), info, produced)
    # Another node is refused: it is not the channel's watcher.
    with pytest.raises(NotWatcherError):
        lease_for_watcher(store, vchannel, 7599)
    other = NodeContext(node_system(store, settings), 7599)
    produce(producer, info.name, produced, 10, 1000)
    producer.time_tick(info.name)
    with pytest.raises(LeaseLostError):
        sync_once(other, info, vchannel, lease=None, force=True)


def test_channels_of_a_dropped_collection_are_released_and_forgotten(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    producer, infos = create_collections(store, settings, count=1, shards=2)
    manager = ChannelManager(store, settings)
    a = nodes.up(7601)
    manager.reconcile()
    answer(store, settings, a)
    producer.drop_collection(infos[0].name)
    report = manager.reconcile()
    assert sorted(v for v, *_ in report.releasing) == sorted(infos[0].vchannels)
    answer(store, settings, a)
    manager.reconcile()
    assert manager.assignments() == {}


def test_the_tickler_keeps_a_slow_watch_from_timing_out(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = replace(fast_settings(settings), tickler_interval=0.2, watch_timeout=1.0)
    one = _assign_one_channel(store, settings, nodes, 7701)
    manager, vchannel, a, key = one.manager, one.vchannel, one.node_id, one.key
    found = (one.info, one.version)
    seen: list[tuple[int, float]] = []

    def slow_start(*_: object) -> None:
        deadline = time.time() + 1.5  # longer than the watch timeout
        while time.time() < deadline:
            now = _watch(store, a, vchannel)
            assert now is not None
            seen.append((now[0].progress, now[0].timeout_ts))
            # The coordinator, meanwhile, does not consider the watch stuck.
            assert not manager.reconcile().removed
            time.sleep(0.1)

    ctx = NodeContext(node_system(store, settings), a)
    result = watch_channel(ctx, key, found[1], found[0], start=slow_start)
    assert result.state is WatchState.WATCH_SUCCESS and result.progress == 100
    assert max(p for p, _ in seen) > 0
    assert max(t for _, t in seen) > found[0].timeout_ts


def test_a_relist_watches_listed_channels_and_releases_unlisted_ones(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    from vchan_assets.datanode.node import DataNode

    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=2)
    v0, v1 = infos[0].vchannels
    node = DataNode(node_system(store, settings), engine="local", poll_interval=0.1).start()
    try:
        manager = ChannelManager(store, settings)
        manager.reconcile()

        _wait_watching(node, sorted([v0, v1]), "the node to watch both channels")
        # As after a compaction: the listing no longer has v1 (deleted while not watching).
        store.delete(store.keys.channel_watch(node.node_id, v1))
        assert node.watcher is not None
        node.watcher.stop()
        node._on_relist(store.list_prefix(store.keys.channel_watch.under(node.node_id)))
        assert node.lanes.wait_idle(30)
        assert node.channels == [v0]
    finally:
        node.stop()


def test_a_relist_read_before_a_watch_event_it_handles_late_does_not_release_that_channel(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    """The relist and the watch stream race: a snapshot read before a ToWatch was written,
    handled after the ToWatch's event, must not release the channel it does not list."""
    from vchan_assets.datanode.node import DataNode

    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=2)
    node = DataNode(node_system(store, settings), engine="local", poll_interval=0.1).start()
    try:
        stale = store.list_prefix(store.keys.channel_watch.under(node.node_id))  # nothing yet
        ChannelManager(store, settings).reconcile()
        _wait_watching(node, sorted(infos[0].vchannels), "the node to watch both channels")
        node._on_relist(stale)
        assert node.lanes.wait_idle(30)
        assert node.channels == sorted(infos[0].vchannels)
    finally:
        node.stop()


def test_the_coordinator_reloads_segment_meta_only_when_its_revision_moved(
    store: MetaStore, settings: Settings
) -> None:
    from vchan_assets.datacoord.coordinator import DataCoordinator

    settings = fast_settings(settings)
    producer, infos = create_collections(store, settings, count=1, shards=1)
    coord = DataCoordinator(settings, store, reload_interval=0)
    assert coord.election.campaign(timeout=10)
    try:
        coord.activate()
        assert coord.reloader is not None and coord.segments is not None
        assert not coord.reloader.reload()
        produce(producer, infos[0].name, Produced(), 10, 1)  # opens a segment
        assert coord.reloader.reload()
        assert [s.vchannel for s in coord.segments.growing()] == [infos[0].vchannels[0]]
        assert not coord.reloader.reload()
    finally:
        coord.election.resign()


def test_a_channel_whose_lease_is_replaced_stops_and_the_node_goes_on(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    from vchan_assets.datacoord.leases import grant_channel_lease
    from vchan_assets.datanode.node import DataNode
    from vchan_assets.meta.allocator import IdAllocator

    settings = fast_settings(settings)
    producer, infos = create_collections(store, settings, count=1, shards=2)
    v0, v1 = infos[0].vchannels
    node = DataNode(node_system(store, settings), engine="local", poll_interval=0.1).start()
    try:
        ChannelManager(store, settings).reconcile()
        _wait_watching(node, sorted([v0, v1]), "the node to watch both channels")
        grant_channel_lease(store, IdAllocator(store), v1, node_id=424242)  # fences the node off v1
        produce(producer, infos[0].name, Produced(), 50, 1)
        producer.time_tick(infos[0].name)
        _wait_watching(node, [v0], "the node to stop the fenced-off channel")
        assert node.lease_losses == 1 and not node.session_lost.is_set()
    finally:
        node.stop()


def test_tickler_progress_updates_are_not_handled_as_new_watch_requests(
    store: MetaStore, settings: Settings
) -> None:
    """The node's own tickler PUTs (ToWatch, progress > 0) come back as watch events; a node
    that re-handles them restarts the channel and its final CAS fails: the channel is left
    WatchSuccess with no worker (Milvus: a PUT with progress != 0 is ignored)."""
    from vchan_assets.datanode.node import DataNode

    # A tick every few ms: every watch outlives the tickler interval.
    settings = replace(fast_settings(settings), tickler_interval=0.002)
    producer, infos = create_collections(store, settings, count=1, shards=1)
    vchannel = infos[0].vchannels[0]
    node = DataNode(node_system(store, settings), engine="local", poll_interval=0.1).start()
    try:
        ChannelManager(store, settings).reconcile()
        key = store.keys.channel_watch(node.node_id, vchannel)

        def watched() -> bool:
            found = store.get_model(key, ChannelWatchInfo)
            return found is not None and found.model.state is WatchState.WATCH_SUCCESS

        wait_until(
            watched,
            10,
            "the channel WatchSuccess in etcd",
            interval=0.05,
            describe=lambda: _watch(store, node.node_id, vchannel),
        )
        time.sleep(1.0)  # the tickler's queued PUTs are delivered meanwhile
        assert node.channels == [vchannel], "WatchSuccess in etcd, but the node runs no worker"
        produced = Produced()
        produce(producer, infos[0].name, produced, 20, 1)
        producer.time_tick(infos[0].name)
        head = producer.time_tick(infos[0].name)[vchannel]

        def checkpoint() -> MsgPosition | None:
            found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
            return None if found is None else found.model

        wait_until(
            lambda: (c := checkpoint()) is not None and c.offset >= head.offset,
            15,
            f"the channel's checkpoint at the head, offset {head.offset}",
            describe=checkpoint,
        )
    finally:
        node.stop()


def _one_watched_channel(
    store: MetaStore, settings: Settings, nodes: Sessions, node_id: int
) -> tuple[ChannelManager, str, int]:
    """One collection of one vchannel, watched (WatchSuccess) by node `node_id`."""
    settings = fast_settings(settings)
    one = _assign_one_channel(store, settings, nodes, node_id)
    answer(store, settings, one.node_id)
    return one.manager, one.vchannel, one.node_id


def test_a_to_watch_that_loses_its_compare_and_swap_grants_no_lease(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    """Lease grant and ToWatch are one transaction: when the ToWatch cannot be written
    (here: the target node's key is taken by a value the manager cannot read), the
    channel's lease is left as it was, so no holder is fenced for nothing."""
    manager, vchannel, a = _one_watched_channel(store, settings, nodes, 7801)
    before = store.read_lease(vchannel)
    assert before is not None and before.node_id == a
    # Node a's watch info is replaced by something unreadable: the manager sees no holder
    # and tries to assign the channel to node a again, whose key is not free.
    store.put(store.keys.channel_watch(a, vchannel), b"not json")
    report = manager.reconcile()
    assert report.conflicts == 1 and not report.assigned
    assert store.read_lease(vchannel) == before


def test_a_holder_fenced_by_a_newer_lease_is_noticed_and_the_channel_reassigned(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    """A WatchSuccess whose lease id is not the channel's current lease holds nothing: the
    node stopped the channel when its commit was refused. The manager removes that watch
    info and assigns the channel again with a new lease."""
    from vchan_assets.datacoord.leases import grant_channel_lease
    from vchan_assets.meta.allocator import IdAllocator

    manager, vchannel, a = _one_watched_channel(store, settings, nodes, 7901)
    fencer = grant_channel_lease(store, IdAllocator(store), vchannel, node_id=424242)
    report = manager.reconcile()
    assert [(v, n) for v, n, _ in report.removed] == [(vchannel, a)]
    assert report.assigned == [(vchannel, a)]
    found = _watch(store, a, vchannel)
    lease = store.read_lease(vchannel)
    assert found is not None and found[0].state is WatchState.TO_WATCH
    assert lease is not None and lease.lease_id == found[0].lease_id != fencer.lease_id


def test_the_no_lease_fallback_never_revokes_a_channel_reassigned_meanwhile(
    store: MetaStore, settings: Settings
) -> None:
    """`lease_for_watcher` (a node watching without a lease id asks DataCoord for one) must
    check "still the watcher" and grant in one transaction: read-then-put can replace the
    lease of the node the channel was just reassigned to. Two threads hammer it while the
    channel moves from node X to node Y and back; after each move to Y, Y's lease stands."""
    import contextlib
    import threading

    from vchan_assets.datacoord.leases import new_channel_lease
    from vchan_assets.meta.allocator import IdAllocator

    _, infos = create_collections(store, fast_settings(settings), count=1, shards=1)
    vchannel = infos[0].vchannels[0]
    x, y = 8101, 8102
    ids = IdAllocator(store)
    x_key, y_key, lease_key = (
        store.keys.channel_watch(x, vchannel),
        store.keys.channel_watch(y, vchannel),
        store.keys.channel_lease(vchannel),
    )
    x_info = ChannelWatchInfo(
        vchan=VchannelInfo(infos[0].id, vchannel),
        state=WatchState.WATCH_SUCCESS,
        start_ts=time.time(),
        timeout_ts=time.time() + 300,
        lease_id=None,
    )
    halt = threading.Event()

    def hammer() -> None:
        while not halt.is_set():
            with contextlib.suppress(NotWatcherError):
                lease_for_watcher(store, vchannel, x, ids)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    revoked = 0
    try:
        for _ in range(60):
            store.delete(y_key)
            store.put(x_key, x_info)  # X watches again (older coordinator: no lease id)
            time.sleep(0.01)
            # The move to Y, as the channel manager writes it.
            store.delete(x_key)
            y_lease = new_channel_lease(ids, y)
            store.txn({}, {lease_key: y_lease, y_key: replace(x_info, lease_id=y_lease.lease_id)})
            time.sleep(0.02)
            if store.read_lease(vchannel) != y_lease:
                revoked += 1
    finally:
        halt.set()
        for t in threads:
            t.join()
    assert revoked == 0, f"Y's lease was replaced after {revoked} of 60 moves"


def test_a_slow_event_of_one_channel_never_delays_another_channels_watch(
    store: MetaStore, settings: Settings
) -> None:
    """Events are handled per channel (Milvus: one event manager per vchannel): while one
    channel's release is still running (its final sync can take up to minutes), another
    channel's ToWatch is answered. The slow release is a job on the first channel's lane
    that ends only when the test says so."""
    import threading

    from vchan_assets.datanode.node import DataNode

    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=2)
    v0, v1 = infos[0].vchannels
    node = DataNode(node_system(store, settings), engine="local", poll_interval=0.1).start()
    releasing, finish = threading.Event(), threading.Event()
    try:
        node.lanes.submit(v0, lambda: (releasing.set(), finish.wait(60)))
        assert releasing.wait(10)
        ChannelManager(store, settings).reconcile()  # ToWatch for both channels on the node

        def state(vchannel: str) -> WatchState | None:
            found = _watch(store, node.node_id, vchannel)
            return found[0].state if found else None

        wait_until(
            lambda: state(v1) is WatchState.WATCH_SUCCESS,
            20,
            "the channel whose lane is free WatchSuccess",
            interval=0.05,
            describe=lambda: state(v1),
        )
        assert state(v0) is WatchState.TO_WATCH  # its lane is still busy with the release
        finish.set()
        assert node.lanes.wait_idle(20)
        assert state(v0) is WatchState.WATCH_SUCCESS
    finally:
        finish.set()
        node.stop()


def test_the_node_checks_the_coordinators_vchannel_info_against_the_meta_it_reads_under_the_lease(
    store: MetaStore, settings: Settings, nodes: Sessions, caplog: pytest.LogCaptureFixture
) -> None:
    """The ToWatch's VchannelInfo is read before the lease is granted; the node reads the
    channel again once the lease is its own. Newer meta (a commit landed in between) is
    logged and used; older meta than the assignment (etcd went back in time) fails the
    watch, and the coordinator's next assignment, read afresh, is watched."""
    settings = fast_settings(settings)
    one = _assign_one_channel(store, settings, nodes, 7701, rows=100)
    manager, vchannel, a, key = one.manager, one.vchannel, one.node_id, one.key
    found = (one.info, one.version)
    assigned = one.info.vchan
    (segment_id,) = assigned.unflushed_segment_ids
    ctx = NodeContext(node_system(store, settings), a)

    # Older than meta: the previous holder's last checkpoint landed after the coordinator read.
    store.put(store.keys.channel_checkpoint(vchannel), encode(MsgPosition(vchannel, 41, 4100)))
    with caplog.at_level("INFO", logger="vchan_assets.datanode.node"):
        result = watch_channel(ctx, key, found[1], found[0])
    assert result.state is WatchState.WATCH_SUCCESS
    assert result.vchan.seek_position == MsgPosition(vchannel, 41, 4100)
    assert f"checkpoint offset {assigned.seek_position.offset} -> 41" in caplog.text  # type: ignore[union-attr]

    # Newer than meta: the assignment says the segment is flushed and the checkpoint at 90.
    ahead = replace(
        assigned,
        seek_position=MsgPosition(vchannel, 90, 9000),
        unflushed_segment_ids=(),
        flushed_segment_ids=(segment_id,),
    )
    found = _rewrite_watch(store, a, vchannel, state=WatchState.TO_WATCH, vchan=ahead)
    result = watch_channel(ctx, key, found[1], found[0])
    assert result.state is WatchState.WATCH_FAILURE
    assert "checkpoint at offset 41, assigned at 90" in result.reason
    assert f"segment {segment_id} flushed -> unflushed" in result.reason

    b = nodes.up(7702)
    report = manager.reconcile()
    assert (vchannel, b) in report.assigned
    again = _watch(store, b, vchannel)
    assert again is not None and again[0].vchan.seek_position == MsgPosition(vchannel, 41, 4100)
    ctx_b = NodeContext(node_system(store, settings), b)
    result = watch_channel(ctx_b, store.keys.channel_watch(b, vchannel), again[1], again[0])
    assert result.state is WatchState.WATCH_SUCCESS
