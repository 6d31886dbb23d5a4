"""The graceful stop with real processes: a DataNode sent SIGTERM says STOPPING and the
coordinator moves its channels at once; SIGKILL in the middle of that hand-over (of the
stopping node, of a node receiving its channels, of the active coordinator) loses and
duplicates nothing and leaves every channel with one owner."""

from __future__ import annotations

import signal

import pytest

from vchan_assets.meta.store import MetaStore
from vchan_assets.testing.harness import (
    Cluster,
    Load,
    OneWriterChecker,
    checkpoint_of,
    create_collections,
    owners,
)
from vchan_assets.testing.steps import finish_and_check
from vchan_assets.testing.waiting import wait_until


@pytest.mark.parametrize("victim", ["stopping node", "receiving node", "coordinator"])
def test_sigkill_during_a_graceful_hand_over_loses_nothing_and_leaves_one_owner(
    cluster: Cluster, store: MetaStore, victim: str
) -> None:
    producer, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    coordinator = cluster.coordinator()
    leaving, receiving, staying = cluster.node(), cluster.node(), cluster.node()
    standby = cluster.coordinator() if victim == "coordinator" else None
    wait_until(lambda: owners(store, channels), 30, "four channels watched")
    load = Load(producer, infos)
    load.start()
    wait_until(lambda: all(checkpoint_of(store, v) for v in channels), 30, "every channel synced once")
    checker = OneWriterChecker(store, channels)
    checker.start()
    leaving.signal(signal.SIGTERM)
    {"stopping node": leaving, "receiving node": receiving, "coordinator": coordinator}[victim].kill9()
    if victim != "stopping node":
        assert leaving.process.wait(30) == 0
    alive = {staying.id} | ({receiving.id} if victim != "receiving node" else set())

    def one_live_owner_each() -> bool:
        now = owners(store, channels)
        return now is not None and set(now.values()) <= alive

    wait_until(one_live_owner_each, cluster.settings.session_ttl + 15, "every channel owned by a live node")
    finish_and_check(cluster, store, (producer, infos), load)
    checker.stop()
    assert checker.samples > 10
    assert not checker.violations, checker.violations[:5]
    if (
        standby is not None
    ):  # it takes over once the killed one's lease expires (the move may have been done before)
        wait_until(
            lambda: "won the election" in standby.log(),
            cluster.settings.session_ttl + 15,
            "the standby active",
        )
