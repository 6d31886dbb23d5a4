"""Sync policies read a channel's real backlog (etcd + log) and say why to sync."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.channel_state import read_channel_state
from vchan_assets.datanode.policies import channel_backlog, sync_reasons
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import Produced, produce
from vchan_assets.wal.producer import Producer
from vchan_assets.wal.reader import WalReader


@pytest.fixture
def channels() -> int:
    return 1  # `collection`'s


def _reasons(
    store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo, **kw: object
) -> list[str]:
    now = kw.pop("now", None)
    state = read_channel_state(store, WalReader(storage, info.vchannels[0], info))
    backlog = channel_backlog(state)
    return sync_reasons(backlog, settings, now)  # type: ignore[arg-type]


def test_nothing_fires_for_a_small_fresh_backlog(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 100, start_pk=0)
    assert _reasons(store, storage, settings, collection) == []


def test_buffered_size_fires_past_the_configured_size(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 2000, start_pk=0)
    small = replace(settings, sync_buffer_mb=0.01)
    reasons = _reasons(store, storage, small, collection)
    assert len(reasons) == 1 and reasons[0].startswith("buffered")


def test_oldest_unsynced_row_fires_when_it_is_older_than_the_max_age(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 100, start_pk=0)
    later = time.time() + settings.sync_max_age + 1
    reasons = _reasons(store, storage, settings, collection, now=later)
    assert len(reasons) == 1 and reasons[0].startswith("oldest unsynced row")


def test_flush_fires_sealed_and_flush_policies_until_a_sync_passes_it(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 100, start_pk=0)
    producer.flush(collection.name)
    reasons = _reasons(store, system.storage, settings, collection)
    assert any(r.startswith("1 sealed segment") for r in reasons)
    assert any(r.startswith("flush requested") for r in reasons)
    vchannel = collection.vchannels[0]
    lease = grant_channel_lease(store, IdAllocator(store), vchannel, node_id=1)
    SyncTask(system, collection, vchannel, lease, engine="local").run()
    assert _reasons(store, system.storage, settings, collection) == []
