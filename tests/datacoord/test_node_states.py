"""Node states (INITIALIZING -> HEALTHY -> ABNORMAL / STOPPING), the graceful stop and the
rolling upgrade, step by step in one process on a real etcd: sessions registered here,
the channel manager's steps driven by the test, a DataNode and DataCoords as objects."""

from __future__ import annotations

import threading
import time

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.channel_manager import ChannelManager
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.datanode.channel import NodeContext, sync_once
from vchan_assets.datanode.node import DataNode
from vchan_assets.meta.codec import decode, encode
from vchan_assets.meta.errors import LeaseLostError
from vchan_assets.meta.session import SessionRefusedError
from vchan_assets.meta.store import MetaStore
from vchan_assets.meta.watch import EventKind, PrefixWatcher, WatchEvent
from vchan_assets.model import (
    ChannelWatchInfo,
    NodeSession,
    SessionState,
    VchannelInfo,
    WatchState,
)
from vchan_assets.storage import Storage
from vchan_assets.testing.harness import Produced, create_collections, fast_settings, produce
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.testing.waiting import wait_until

from .helpers import Sessions, answer, node_system


def _one_owner_each(manager: ChannelManager, channels: list[str]) -> dict[str, int]:
    """Every channel has exactly one holder; returns channel -> node."""
    found = manager.assignments()
    owners = {}
    for v in channels:
        holding = [n for n, s in found.get(v, []) if s in (WatchState.WATCH_SUCCESS, WatchState.TO_WATCH)]
        assert len(holding) == 1, (v, found.get(v))
        owners[v] = holding[0]
    return owners


def test_only_a_healthy_node_gets_channels_and_a_stopping_nodes_channels_move_at_once(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    manager = ChannelManager(store, settings)
    nodes.up(9101)
    nodes.up(9102, SessionState.INITIALIZING)
    nodes.up(9103, SessionState.ABNORMAL)
    report = manager.reconcile()
    assert report.live_nodes == (9101,)
    assert set(_one_owner_each(manager, channels).values()) == {9101}
    answer(store, settings, 9101)
    leases = {v: store.read_lease(v) for v in channels}
    nodes.enter(9102, SessionState.HEALTHY)
    nodes.enter(9101, SessionState.STOPPING)
    # One step: no session has expired, yet every channel of the stopping node moves.
    report = manager.reconcile()
    assert sorted(v for v, _, why in report.removed if why == "node is STOPPING") == sorted(channels)
    assert set(_one_owner_each(manager, channels).values()) == {9102}
    for v in channels:
        lease = store.read_lease(v)
        old = leases[v]
        assert lease is not None and old is not None
        assert lease.node_id == 9102 and lease.lease_id != old.lease_id  # the stopping node is fenced off


def test_a_node_stopping_past_the_stop_timeout_is_cut_off_and_its_old_session_is_refused(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    settings = fast_settings(settings)
    manager = ChannelManager(store, settings)
    stuck = nodes.held[nodes.up(9201, ttl=3)]
    nodes.enter(9201, SessionState.STOPPING, since=time.time() - 5)
    assert not manager.reconcile().cut_off  # within VCHAN_STOP_TIMEOUT (30 s)
    report = manager.reconcile(now=time.time() + settings.stop_timeout)
    assert report.cut_off == [9201]
    assert store.get(store.keys.datanode_session(9201)) is None
    # The node comes back under its old session: refused, and nothing is written.
    assert isinstance(stuck.value, NodeSession)
    with pytest.raises(SessionRefusedError):
        stuck.update(stuck.value.entered(SessionState.HEALTHY))
    assert store.get(store.keys.datanode_session(9201)) is None
    wait_until(lambda: stuck.expired, 60, "the cut-off node's session noticed it is gone")


def test_a_mixed_version_cluster_holds_balance_upgrades_lease_less_watches_and_never_has_two_owners(
    store: MetaStore, settings: Settings, nodes: Sessions
) -> None:
    """Node 9301 speaks the older protocol: its session has no state, its watch infos were
    written by an older coordinator (no lease id), and it commits through the DataCoord's
    watcher check. Node 9302 is new."""
    settings = fast_settings(settings)
    producer, infos = create_collections(store, settings, count=1, shards=4)
    info, channels = infos[0], list(infos[0].vchannels)
    old = 9301
    lease = store.grant(30)
    old_session = {"node_id": old, "address": "", "version": "0.0.9", "started_at": time.time()}
    store.put(store.keys.datanode_session(old), encode(old_session), lease=lease)
    for v in channels:
        store.put(
            store.keys.channel_watch(old, v),
            ChannelWatchInfo(
                VchannelInfo(info.id, v), WatchState.WATCH_SUCCESS, time.time(), time.time() + 60
            ),
        )
    old_ctx = NodeContext(node_system(store, settings), old)
    produced = Produced()
    produce(producer, info.name, produced, 200, 1, deletes=3)
    producer.time_tick(info.name)
    assert sync_once(old_ctx, info, channels[0], lease=None, force=True) is not None  # the older path

    nodes.up(9302)  # the new node
    manager = ChannelManager(store, settings)
    report = manager.reconcile()
    # The new node has nothing and the old one four, but auto balance waits for the old one.
    assert report.balance_held == [old] and not report.releasing
    assert sorted(v for v, _ in report.upgraded) == sorted(channels)
    for v in channels:
        found = store.get_model(store.keys.channel_watch(old, v), ChannelWatchInfo)
        current = store.read_lease(v)
        assert found is not None and current is not None
        assert found.model.lease_id == current.lease_id and current.node_id == old
    assert not manager.reconcile().changed  # upgraded once; nothing else moves
    assert set(_one_owner_each(manager, channels).values()) == {old}
    # The old node goes on committing through the watcher check, under the upgraded lease.
    produce(producer, info.name, produced, 100, 1000)
    producer.time_tick(info.name)
    assert sync_once(old_ctx, info, channels[1], lease=None, force=True) is not None

    store.revoke(lease)  # the old node leaves (the upgrade of its host)
    report = manager.reconcile()
    assert sorted(v for v, _ in report.assigned) == sorted(channels) and not report.balance_held
    assert set(_one_owner_each(manager, channels).values()) == {9302}
    with pytest.raises(LeaseLostError):  # a late commit of the old node is refused
        sync_once(old_ctx, info, channels[2], lease=None, force=True)
    answer(store, settings, 9302)
    new_ctx = NodeContext(node_system(store, settings), 9302)
    for v in channels:
        current = store.read_lease(v)
        assert current is not None
        sync_once(new_ctx, info, v, current, force=True)
    assert_exactly_once(store, Storage.from_settings(settings), info, produced)


def test_a_datanode_goes_healthy_then_says_stopping_before_its_session_ends(
    store: MetaStore, settings: Settings
) -> None:
    settings = fast_settings(settings)
    prefix = store.keys.datanode_session.prefix
    seen: list[tuple[str, str]] = []

    def on_event(e: WatchEvent) -> None:
        state = "gone" if e.kind is EventKind.DELETE else decode(e.key, e.value, NodeSession).state.value
        seen.append((e.key, state))

    with PrefixWatcher(store, prefix, on_event=on_event, on_relist=lambda s: None) as watcher:
        watcher.wait_for(store.revision(), 10)
        node = DataNode(node_system(store, settings)).start()
        assert node.ready.wait(10) and node.state is SessionState.HEALTHY
        node.stop(final_sync=False)
        key = store.keys.datanode_session(node.node_id)
        wait_until(lambda: (key, "gone") in seen, 10, "the session ended")
    assert [s for k, s in seen if k == key] == ["INITIALIZING", "HEALTHY", "STOPPING", "gone"]


def test_a_stopping_datacoord_says_stopping_and_the_watching_standby_takes_over(
    store: MetaStore, settings: Settings
) -> None:
    settings = fast_settings(settings)
    key = store.keys.datacoord_session()
    seen: list[str] = []

    def on_event(e: WatchEvent) -> None:
        seen.append("gone" if e.kind is EventKind.DELETE else decode(key, e.value, NodeSession).state.value)

    first, second = DataCoordinator(settings, store), DataCoordinator(settings, store)
    stop_first, stop_second = threading.Event(), threading.Event()
    runners = [
        threading.Thread(target=first.run, args=(stop_first,), daemon=True),
        threading.Thread(target=second.run, args=(stop_second,), daemon=True),
    ]
    with PrefixWatcher(store, key, on_event=on_event, on_relist=lambda s: None) as watcher:
        watcher.wait_for(store.revision(), 10)
        runners[0].start()
        assert first.active.wait(15)
        runners[1].start()
        time.sleep(0.5)  # the standby campaigns (watching the key)
        assert not second.active.is_set()
        stop_first.set()
        assert second.active.wait(10), "the standby did not take over"
        runners[0].join(10)
        stop_second.set()
        runners[1].join(10)
        wait_until(lambda: seen.count("gone") >= 2, 10, "both resigned")
    # The first term: HEALTHY, STOPPING, gone; then the standby's term.
    assert seen[:4] == ["HEALTHY", "STOPPING", "gone", "HEALTHY"], seen
