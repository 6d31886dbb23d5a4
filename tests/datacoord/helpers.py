"""Shared steps of the coordination tests: real `vchan datanode` / `vchan datacoord`
processes on a real etcd, and views of what etcd says about channels."""

from __future__ import annotations

import threading
import time

from datanode.helpers import assert_exactly_once

from vchan_assets import __version__
from vchan_assets.config import Settings
from vchan_assets.datanode.channel import NodeContext
from vchan_assets.datanode.node import release_channel, watch_channel
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, CollectionInfo, NodeSession, SessionState, WatchState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    FAST,
    Cluster,
    Produced,
    Role,
    Watch,
    all_synced,
    checkpoint_of,
    create_collections,
    fast_settings,
    owners,
    produce,
    wait_until,
    watches,
)
from vchan_assets.wal.producer import Producer

__all__ = [
    "FAST",
    "Cluster",
    "Load",
    "OneWriterChecker",
    "Sessions",
    "answer",
    "node_system",
    "Role",
    "Watch",
    "all_synced",
    "checkpoint_of",
    "create_collections",
    "fast_settings",
    "finish_and_check",
    "owners",
    "wait_until",
    "watches",
]


class OneWriterChecker(threading.Thread):
    """Samples etcd continuously; records every moment a channel had two WatchSuccess
    infos, or a WatchSuccess whose lease was not the channel's current lease holder's
    while another node's WatchSuccess held it."""

    def __init__(self, store: MetaStore, channels: list[str]) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.channels = channels
        self.samples = 0
        self.violations: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            found, leases = watches(self.store)
            self.samples += 1
            for vchannel in self.channels:
                holders = [w for w in found.get(vchannel, []) if w.state is WatchState.WATCH_SUCCESS]
                if len(holders) > 1:
                    self.violations.append(f"{vchannel}: two watchers {holders}")
                lease = leases.get(vchannel)
                for w in holders:
                    if lease is not None and lease.lease_id != w.lease_id and len(holders) > 1:
                        self.violations.append(f"{vchannel}: {w} without the lease {lease}")
            time.sleep(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


class Load(threading.Thread):
    """A producer writing batches into the collections until stopped (the "load")."""

    def __init__(self, producer: Producer, infos: list[CollectionInfo], rows: int = 40) -> None:
        super().__init__(daemon=True)
        self.producer = producer
        self.infos = infos
        self.rows = rows
        self.produced = {info.name: Produced() for info in infos}
        self.batches = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        pk = 1
        try:
            while not self._halt.is_set():
                for info in self.infos:
                    produce(self.producer, info.name, self.produced[info.name], self.rows, pk, deletes=2)
                    pk += self.rows
                self.batches += 1
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        assert self.error is None, f"producer failed: {self.error}"


def finish_and_check(cluster: Cluster, store: MetaStore, producer_infos: tuple, load: Load) -> None:
    """Stop the load, let the nodes sync everything, then check exactly-once."""
    producer, infos = producer_infos
    load.stop()
    for info in infos:
        producer.time_tick(info.name)
    storage = Storage.from_settings(cluster.settings)
    wait_until(lambda: all_synced(store, storage, infos), 40, "every channel synced to its head")
    for info in infos:
        assert_exactly_once(store, storage, info, load.produced[info.name])


class Sessions:
    """DataNode sessions registered in this process (no node loop: the test answers for
    them), in the state and with the package version a test needs."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self.held: dict[int, Session] = {}

    def up(
        self,
        node_id: int,
        state: SessionState = SessionState.HEALTHY,
        version: str = __version__,
        ttl: float = 30,
    ) -> int:
        record = NodeSession(node_id, "", version, time.time(), state, time.time())
        self.held[node_id] = Session.for_datanode(self.store, record, ttl=ttl).register()
        return node_id

    def enter(self, node_id: int, state: SessionState, since: float | None = None) -> None:
        session = self.held[node_id]
        assert isinstance(session.value, NodeSession)
        session.update(session.value.entered(state, since))

    def down(self, node_id: int) -> None:
        self.held.pop(node_id).close()

    def close(self) -> None:
        for s in self.held.values():
            s.close()


def node_system(store: MetaStore, settings: Settings) -> System:
    return System(settings, store, Storage.from_settings(settings))


def answer(store: MetaStore, settings: Settings, node_id: int) -> None:
    """What a node does with its ToWatch/ToRelease infos (no channel work started)."""
    ctx = NodeContext(node_system(store, settings), node_id)
    for kv in store.list_prefix(store.keys.channel_watch.under(node_id)).items:
        found = store.get_model(kv.key, ChannelWatchInfo)
        assert found is not None
        if found.model.state is WatchState.TO_WATCH:
            watch_channel(ctx, kv.key, kv.version, found.model)
        elif found.model.state is WatchState.TO_RELEASE:
            release_channel(ctx, kv.key, kv.version, found.model)
