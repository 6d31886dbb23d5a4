"""Chaos under a producer: a seeded random schedule of faults against real `vchan
datanode` / `vchan datacoord` processes and a private etcd, then every row and delete
exactly once in the binlogs (value by value, against what was produced) and every
channel caught up. The schedule is reproducible: VCHAN_CHAOS_SEED picks another one."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from datanode.helpers import Produced, assert_exactly_once, produce

from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer

from .helpers import Cluster, Role, all_synced, create_collections, owners, wait_until

SEED = int(os.environ.get("VCHAN_CHAOS_SEED", "20261123"))
CHAOS_SECONDS = 40.0
FAULTS = ("kill_node", "kill_coordinator", "pause_node_past_ttl", "restart_etcd")


class PausableLoad(threading.Thread):
    """A producer writing batches until stopped; paused (between batches) while etcd is
    down, so that no insert ends in doubt (appended or not) and `produced` is exact."""

    def __init__(self, producer: Producer, info: CollectionInfo, rows: int = 40) -> None:
        super().__init__(daemon=True)
        self.producer, self.info, self.rows = producer, info, rows
        self.produced = Produced()
        self.error: BaseException | None = None
        self._go, self._idle, self._halt = threading.Event(), threading.Event(), threading.Event()
        self._go.set()

    def run(self) -> None:
        pk = 1
        try:
            while not self._halt.is_set():
                if not self._go.is_set():
                    self._idle.set()
                    self._go.wait(0.1)
                    continue
                self._idle.clear()
                produce(self.producer, self.info.name, self.produced, self.rows, pk, deletes=2)
                pk += self.rows
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc

    def pause(self) -> None:
        self._go.clear()
        wait_until(self._idle.is_set, 60, "the producer to finish its batch")

    def resume(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._halt.set()
        self._go.set()
        self.join(60)
        assert self.error is None, f"producer failed: {self.error}"


def live(roles: list[Role]) -> list[Role]:
    return [r for r in roles if r.process.poll() is None]


def test_a_seeded_chaos_schedule_under_a_producer_loses_and_duplicates_nothing(
    private_cluster: Cluster, private_store: MetaStore, private_etcd: EmbeddedEtcd
) -> None:
    cluster, store = private_cluster, private_store
    rng = random.Random(SEED)
    producer, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    nodes = [cluster.node() for _ in range(3)]
    coordinators = [cluster.coordinator() for _ in range(2)]
    wait_until(lambda: owners(store, channels), 40, "every channel watched")
    load = PausableLoad(producer, infos[0])
    load.start()
    ttl = cluster.settings.session_ttl
    survived: list[str] = []
    ends = time.monotonic() + CHAOS_SECONDS
    while time.monotonic() < ends:
        # Roles that died (killed, or exited after losing their session) are replaced.
        nodes += [cluster.node() for _ in range(3 - len(live(nodes)))]
        coordinators += [cluster.coordinator() for _ in range(2 - len(live(coordinators)))]
        fault = rng.choice(FAULTS)
        if fault == "kill_node":
            rng.choice(live(nodes)).kill9()
        elif fault == "kill_coordinator":
            rng.choice(live(coordinators)).kill9()
        elif fault == "pause_node_past_ttl":
            victim = rng.choice(live(nodes))
            victim.signal(signal.SIGSTOP)
            time.sleep(ttl + 1)  # its session expires: it is fenced and its channels move
            victim.signal(signal.SIGCONT)
        else:
            load.pause()
            private_etcd.kill()
            private_etcd.restart()
            load.resume()
        survived.append(fault)
        time.sleep(rng.uniform(1.0, 4.0))

    nodes += [cluster.node() for _ in range(2 - len(live(nodes)))]
    coordinators += [cluster.coordinator() for _ in range(1 - len(live(coordinators)))]
    load.stop()
    producer.time_tick(infos[0].name)
    storage = Storage.from_settings(cluster.settings)
    wait_until(lambda: all_synced(store, storage, infos), 90, f"every channel caught up after {survived}")
    assert_exactly_once(store, storage, infos[0], load.produced)
    assert len(survived) >= 5 and set(survived) > {"kill_node"}, survived
