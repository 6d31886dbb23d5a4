"""Shared steps of the coordination tests: real `vchan datanode` / `vchan datacoord`
processes on a real etcd, and views of what etcd says about channels."""

from __future__ import annotations

import threading
import time

from datanode.helpers import assert_exactly_once

from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, WatchState
from vchan_assets.storage import Storage
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
