"""Chaos under a producer: a seeded random schedule of faults against real `vchan
datanode` / `vchan datacoord` processes and a private etcd, then every row and delete
exactly once in the binlogs (value by value, against what was produced) and every
channel caught up. The schedule is reproducible: VCHAN_CHAOS_SEED picks another one."""

from __future__ import annotations

import os

from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.testing.harness import (
    ChaosSchedule,
    Cluster,
    PausableLoad,
    all_synced,
    create_collections,
    owners,
)
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.testing.waiting import wait_until

SEED = int(os.environ.get("VCHAN_CHAOS_SEED", "20261123"))
FAULTS = 6  # a number, not a duration: under load each fault takes longer


def test_a_seeded_chaos_schedule_under_a_producer_loses_and_duplicates_nothing(
    private_cluster: Cluster, private_store: MetaStore, private_etcd: EmbeddedEtcd
) -> None:
    cluster, store = private_cluster, private_store
    cluster.coordinator_engine = "local"  # sorts in the coordinators' processes: no Spark JVM per coordinator
    producer, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    load = PausableLoad(producer, infos[0])
    chaos = ChaosSchedule(cluster, private_etcd, load, SEED, nodes=3, coordinators=2)
    chaos.replenish(nodes=3, coordinators=2)
    wait_until(lambda: owners(store, channels), 40, "every channel watched")
    load.start()
    survived = chaos.run(faults=FAULTS)

    chaos.replenish(nodes=2, coordinators=1)
    load.stop()
    producer.time_tick(infos[0].name)
    storage = Storage.from_settings(cluster.settings)
    wait_until(lambda: all_synced(store, storage, infos), 300, f"every channel caught up after {survived}")
    assert_exactly_once(store, storage, infos[0], load.produced)
    assert len(survived) == FAULTS and set(survived) > {"kill_node"}, survived
