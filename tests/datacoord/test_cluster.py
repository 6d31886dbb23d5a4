"""Channel coordination with real processes: DataNodes and DataCoords as `vchan`
processes on a real etcd, killed with SIGKILL and paused with SIGSTOP for real."""

from __future__ import annotations

import signal
import threading
import time

from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, NodeSession, SessionState, VchannelInfo, WatchState
from vchan_assets.storage import Storage
from vchan_assets.testing.harness import (
    Cluster,
    Load,
    OneWriterChecker,
    Produced,
    all_synced,
    checkpoint_of,
    create_collections,
    owners,
    produce,
)
from vchan_assets.testing.steps import assert_exactly_once, finish_and_check
from vchan_assets.testing.waiting import wait_until


def test_three_nodes_watch_eight_channels_and_a_fourth_node_is_balanced_in_without_two_writers(
    cluster: Cluster, store: MetaStore
) -> None:
    _, infos = create_collections(store, cluster.settings)
    channels = [v for info in infos for v in info.vchannels]
    nodes = [cluster.node() for _ in range(3)]
    cluster.coordinator()
    wait_until(lambda: owners(store, channels), 30, "eight channels watched")
    placed = owners(store, channels)
    assert placed is not None
    counts = sorted(list(placed.values()).count(n.id) for n in nodes)
    assert counts == [2, 3, 3], placed

    checker = OneWriterChecker(store, channels)
    checker.start()
    fourth = cluster.node()

    def balanced() -> bool:
        now = owners(store, channels)
        return now is not None and sorted(list(now.values()).count(n.id) for n in [*nodes, fourth]) == [
            2,
            2,
            2,
            2,
        ]

    wait_until(balanced, 40, "four nodes with two channels each")
    time.sleep(1)
    checker.stop()
    assert checker.samples > 20
    assert not checker.violations, checker.violations[:5]


def test_kill_9_of_a_node_under_load_moves_its_channels_and_loses_or_duplicates_nothing(
    cluster: Cluster, store: MetaStore
) -> None:
    producer, infos = create_collections(store, cluster.settings)
    channels = [v for info in infos for v in info.vchannels]
    nodes = [cluster.node() for _ in range(3)]
    cluster.coordinator()
    wait_until(lambda: owners(store, channels), 30, "eight channels watched")
    load = Load(producer, infos)
    load.start()
    wait_until(lambda: all(checkpoint_of(store, v) for v in channels), 30, "every channel synced once")
    before = owners(store, channels)
    assert before is not None
    victim = nodes[0]
    moved = [v for v, n in before.items() if n == victim.id]
    checkpoints = {v: checkpoint_of(store, v) for v in moved}
    victim.kill9()

    def taken_over() -> bool:
        now = owners(store, channels)
        return now is not None and all(now[v] != victim.id for v in moved)

    # How soon they move (the TTL and a few seconds) is measured by bench.failover; here,
    # on a loaded machine, only that they do.
    wait_until(taken_over, cluster.settings.session_ttl + 60, "the victim's channels WatchSuccess elsewhere")

    def resumed() -> bool:
        for v in moved:
            cp, old = checkpoint_of(store, v), checkpoints[v]
            if cp is None or old is None or cp.offset <= old.offset:
                return False
        return True

    wait_until(resumed, 120, "syncing resumed from the checkpoint on the new owners")
    finish_and_check(cluster, store, (producer, infos), load)


def test_a_node_paused_mid_sync_past_its_ttl_is_fenced_by_the_lease_when_it_resumes(
    cluster: Cluster, store: MetaStore
) -> None:
    producer, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    cluster.coordinator()
    marker = cluster.tmp / "paused"
    # The node SIGSTOPs itself in its first sync, after writing binlogs, before any meta.
    paused = cluster.node(VCHAN_FAILPOINT="after_binlogs=stop", VCHAN_FAILPOINT_MARKER=str(marker))
    other = cluster.node()
    load = Load(producer, infos)
    load.start()
    wait_until(marker.exists, 30, "the node paused in the middle of a sync")

    def moved() -> bool:
        now = owners(store, channels)
        return now is not None and set(now.values()) == {other.id}

    wait_until(moved, cluster.settings.session_ttl + 10, "the paused node's channels moved")
    wait_until(lambda: all(checkpoint_of(store, v) for v in channels), 120, "the new owner synced")
    # Resume it (again, should another of its channels reach the failpoint before it exits).
    deadline = time.monotonic() + 40
    while paused.process.poll() is None and time.monotonic() < deadline:
        paused.signal(signal.SIGCONT)
        time.sleep(0.2)
    assert paused.process.wait(60) == 4, "the node exits with 'session lost'"
    log = paused.log()
    assert "lost its session" in log
    # Its in-flight work failed instead of committing: rejected by the lease (LeaseLostError),
    # or, when its first etcd call after the pause hit a stale connection, failed there and
    # was not retried because the session was already lost (the process may exit before the
    # paused channel logs anything). Either way nothing of it landed: checked below.
    assert "was revoked or replaced" in log or "unavailable during" in log, log[-3000:]
    assert "WatchSuccess" not in log.split("lost its session")[-1]
    finish_and_check(cluster, store, (producer, infos), load)


def test_standby_coordinator_takes_over_and_finishes_a_pending_move(
    cluster: Cluster, store: MetaStore
) -> None:
    _, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    # The first node has a long TTL: paused, it stays "alive" and so cannot answer a move.
    first = cluster.node(VCHAN_SESSION_TTL="60")
    active = cluster.coordinator()
    wait_until(lambda: owners(store, channels), 30, "four channels watched by the first node")
    standby = cluster.coordinator()
    time.sleep(1)
    assert "won the election" not in standby.log()
    first.signal(signal.SIGSTOP)
    second = cluster.node()
    first_prefix = store.keys.channel_watch.under(first.id)
    wait_until(
        lambda: b"ToRelease" in b"".join(kv.value for kv in store.list_prefix(first_prefix).items),
        20,
        "the active coordinator started moving channels to the new node",
    )
    active.kill9()  # in the middle of the move: ToRelease written, no answer yet
    wait_until(
        lambda: "won the election" in standby.log(), cluster.settings.session_ttl + 10, "standby active"
    )
    first.signal(signal.SIGCONT)  # the first node answers ReleaseSuccess to the new coordinator

    def finished() -> bool:
        now = owners(store, channels)
        return now is not None and sorted(list(now.values()).count(n.id) for n in (first, second)) == [2, 2]

    wait_until(finished, 30, "the standby finished the move: two channels each")
    assert first.process.poll() is None and second.process.poll() is None


def test_etcd_restarted_during_a_sync_the_cluster_recovers_on_its_own(
    private_cluster: Cluster, private_store: MetaStore, private_etcd: EmbeddedEtcd
) -> None:
    cluster, store = private_cluster, private_store
    # Sessions outlive the restart: the syncing node is stopped from its failpoint until the
    # restart is over, its keep-alives with it (8 s was passed under a load of 12: the node
    # lost its session and exited, by design).
    cluster.env_extra["VCHAN_SESSION_TTL"] = "30"
    producer, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    produced = Produced()
    pk = 1
    for _ in range(4):
        produce(producer, infos[0].name, produced, 200, pk, deletes=3)
        pk += 200
    coordinator = cluster.coordinator()
    marker = cluster.tmp / "in-sync"
    # This node stops itself inside a sync (binlogs written, no meta yet) ...
    syncing = cluster.node(VCHAN_FAILPOINT="after_binlogs=stop", VCHAN_FAILPOINT_MARKER=str(marker))
    other = cluster.node()
    wait_until(lambda: marker.exists() and _state(syncing.pid) == "T", 30, "a sync in flight")
    private_etcd.restart()  # ... etcd restarts under it ...
    resumed = threading.Event()

    def keep_resuming() -> None:  # ... and it resumes (at this and every later failpoint)
        while not resumed.is_set() and syncing.process.poll() is None:
            syncing.signal(signal.SIGCONT)
            time.sleep(0.1)

    resumer = threading.Thread(target=keep_resuming, daemon=True)
    resumer.start()
    try:
        wait_until(lambda: owners(store, channels), 40, "every channel watched after the restart")
        for _ in range(3):
            produce(producer, infos[0].name, produced, 200, pk, deletes=3)
            pk += 200
        producer.time_tick(infos[0].name)
        storage = Storage.from_settings(cluster.settings)
        wait_until(lambda: all_synced(store, storage, infos), 40, "every channel synced after the restart")
        assert_exactly_once(store, storage, infos[0], produced)
        assert all(role.process.poll() is None for role in (syncing, other, coordinator))
    finally:
        resumed.set()
        resumer.join(5)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0]


def test_malformed_watch_infos_and_sessions_are_logged_and_skipped(
    cluster: Cluster, store: MetaStore
) -> None:
    _, infos = create_collections(store, cluster.settings, count=1, shards=2)
    channels = list(infos[0].vchannels)
    node = cluster.node()
    keys = store.keys
    # A well-formed ToWatch for a collection that does not exist: the node answers WatchFailure.
    # Written before any coordinator runs: a coordinator retires a channel of no collection
    # itself (ToRelease), and when its step ran first the node never answered WatchFailure.
    ghost_key = keys.channel_watch(node.id, "ghost-channel")
    ghost = ChannelWatchInfo(
        VchannelInfo(987654, "ghost-channel"), WatchState.TO_WATCH, time.time(), time.time() + 60, lease_id=1
    )
    store.put(ghost_key, ghost)

    def answered() -> bool:
        found = store.get_model(ghost_key, ChannelWatchInfo)
        return found is not None and found.model.state is WatchState.WATCH_FAILURE

    wait_until(answered, 30, "the node answered WatchFailure")
    coordinator = cluster.coordinator()
    wait_until(lambda: owners(store, channels), 30, "channels watched")
    store.put(keys.channel_watch(node.id, "bogus-not-json"), b"{not json")
    store.put(keys.channel_watch(node.id, "wrong-version"), b'{"v": 99, "state": "ToWatch"}')
    store.put(keys.datanode_session(424242), b"[1, 2]")
    store.put(keys.datanode_session(434343), b'{"v": 1, "node_id": "x"}')
    wait_until(
        lambda: "bogus-not-json" in node.log() and "wrong-version" in node.log(), 15, "node logged both"
    )
    wait_until(
        lambda: "424242" in coordinator.log() and "434343" in coordinator.log(), 15, "coord logged sessions"
    )
    assert "skipping malformed watch info" in node.log()
    # The coordinator removes the ghost channel (no such collection) once the node answered.
    wait_until(lambda: store.get(ghost_key) is None, 15, "ghost removed")
    assert "ghost-channel" in node.log() and "WatchFailure" in node.log()
    time.sleep(1)
    assert node.process.poll() is None and coordinator.process.poll() is None
    assert owners(store, channels) is not None


def test_a_spark_datanode_syncs_a_channel_end_to_end(cluster: Cluster, store: MetaStore) -> None:
    producer, infos = create_collections(store, cluster.settings, count=1, shards=1)
    node = cluster.node(engine="spark", poll=0.5, VCHAN_SESSION_TTL="10")
    cluster.coordinator()

    def healthy() -> bool:
        found = store.get_model(store.keys.datanode_session(node.id), NodeSession)
        return found is not None and found.model.state is SessionState.HEALTHY

    # The node is HEALTHY (and gets the channel) only once its Spark session is up.
    wait_until(healthy, 240, "the Spark node HEALTHY")
    assert "Spark session up" in node.log()
    wait_until(lambda: owners(store, list(infos[0].vchannels)), 30, "the channel watched")
    produced = Produced()
    produce(producer, infos[0].name, produced, 500, 1, deletes=5)
    produce(producer, infos[0].name, produced, 500, 501)
    producer.time_tick(infos[0].name)
    storage = Storage.from_settings(cluster.settings)
    wait_until(lambda: all_synced(store, storage, infos), 120, "the Spark node synced the channel")
    assert_exactly_once(store, storage, infos[0], produced)
    assert node.terminate() == 0
    log = node.log()
    assert "engine spark" in log
    assert log.index("Spark session up") < log.index(" syncing ")  # no sync paid the JVM start


def test_sigterm_releases_a_nodes_channels_and_hands_over_the_coordinator_at_once(
    cluster: Cluster, store: MetaStore
) -> None:
    # Long TTLs: anything that moves within seconds moved because of the clean shutdown.
    cluster.env_extra["VCHAN_SESSION_TTL"] = "60"
    producer, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    first_coord = cluster.coordinator()
    leaving, staying = cluster.node(), cluster.node()
    wait_until(lambda: owners(store, channels), 30, "four channels watched")
    second_coord = cluster.coordinator()
    produced = Produced()
    produce(producer, infos[0].name, produced, 300, 1, deletes=3)
    producer.time_tick(infos[0].name)
    assert leaving.terminate() == 0
    assert "lost its session" not in leaving.log()
    wait_until(
        lambda: (now := owners(store, channels)) is not None and set(now.values()) == {staying.id},
        10,
        "the stopped node's channels moved without waiting for its TTL",
    )
    assert first_coord.terminate() == 0
    wait_until(
        lambda: "won the election" in second_coord.log(),
        10,
        "the standby took over at once",
        describe=lambda: (
            f"the leader's log ends: {first_coord.log()[-1500:]}; the standby's: {second_coord.log()[-1500:]}"
        ),
    )
    storage = Storage.from_settings(cluster.settings)
    wait_until(lambda: all_synced(store, storage, infos), 30, "every channel synced")
    assert_exactly_once(store, storage, infos[0], produced)
