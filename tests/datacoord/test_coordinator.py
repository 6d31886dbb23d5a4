"""The DataCoordinator's term: every write fenced by the election it won, and the
periodic meta reload."""

from __future__ import annotations

import time

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.meta.errors import MetaError
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import NodeSession, SegmentInfo, SessionState
from vchan_assets.testing.harness import Produced, create_collections, fast_settings, produce


def healthy_node(store: MetaStore, settings: Settings, node_id: int) -> Session:
    record = NodeSession(node_id, "test", "0", time.time(), SessionState.HEALTHY)
    return Session.for_datanode(store, record, 60).register()


def test_a_coordinator_deposed_mid_tick_writes_nothing(store: MetaStore, settings: Settings) -> None:
    """A coordinator paused past its TTL (its election key expired and a standby won) that
    resumes in the middle of a tick must not grant a lease or write a ToWatch: every
    coordinator write compares the election key with the writer's own term."""
    settings = fast_settings(settings)
    _, infos = create_collections(store, settings, count=1, shards=2)
    old = DataCoordinator(settings, store)
    assert old.election.campaign(timeout=10)
    old.activate()
    session = old.election.session
    assert session is not None and session.lease_id is not None
    session.suspend_keepalive()
    node = healthy_node(store, settings, 9301)
    new = DataCoordinator(settings, store)
    try:
        store.revoke(session.lease_id)  # as etcd expiring the paused leader's lease
        assert new.election.campaign(timeout=10)
        watch_root = store.keys.channel_watch.prefix

        with pytest.raises(MetaError, match="not the leader"):
            old.tick()  # the deposed one resumes mid-term
        assert store.list_prefix(watch_root).items == []
        assert store.list_prefix(store.keys.channel_lease.prefix).items == []

        report = new.tick().channels
        assert sorted(v for v, _ in report.assigned) == sorted(infos[0].vchannels)
    finally:
        node.close()
        old.election.resign()
        new.election.resign()


def test_the_meta_reload_notices_a_deleted_segment(store: MetaStore, settings: Settings) -> None:
    """Segment meta is reloaded when it changed; a deletion moves no remaining key's mod
    revision, so comparing the highest revision alone never saw it."""
    settings = fast_settings(settings)
    producer, infos = create_collections(store, settings, count=1, shards=2)
    produce(producer, infos[0].name, Produced(), 20, 1)  # opens a segment per channel
    coord = DataCoordinator(settings, store, reload_interval=0)
    assert coord.election.campaign(timeout=10)
    try:
        coord.activate()
        assert coord.reloader is not None
        assert not coord.reloader.reload()
        found, _ = store.list_models(store.keys.segment.prefix, SegmentInfo)
        assert len(found) >= 2
        oldest = min(found, key=lambda d: d.kv.mod_revision)
        store.delete(oldest.kv.key)  # as GC removing a dropped segment's meta

        assert coord.reloader.reload()
        assert not coord.reloader.reload()
    finally:
        coord.election.resign()
