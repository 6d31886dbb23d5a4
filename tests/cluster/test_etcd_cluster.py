"""The whole cluster on a 3-member etcd: a producer, two DataNodes and two DataCoords,
while the etcd leader is killed with SIGKILL mid-sync and during a coordinator election.
The etcd clients (MultiEndpointEtcd3Client) fail over to the other members."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import psutil
import pytest

from vchan_assets.config import Settings
from vchan_assets.deploy.etcd_cluster import EtcdCluster
from vchan_assets.meta.channel_head import ChannelHeads
from vchan_assets.meta.errors import MetaUnavailableError
from vchan_assets.meta.store import ENDPOINT_RETRY_SECONDS, MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    SCHEMA,
    Cluster,
    Produced,
    Role,
    all_synced,
    checkpoint_of,
    fast_settings,
    owners,
)
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import PATIENCE, advanced, checkpoints


def retrying(call: Callable[[], object], attempts: int = 100) -> object:
    """A client call retried while etcd elects a leader (the client moves to another member)."""
    for attempt in range(attempts):
        try:
            return call()
        except MetaUnavailableError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1)
    return None


def tolerant(condition: Callable[[], object]) -> Callable[[], object]:
    def check() -> object:
        try:
            return condition()
        except MetaUnavailableError:
            return False

    return check


class FailoverLoad(threading.Thread):
    """A producer inserting into one-channel collections until stopped; an insert or delete
    that meets an unavailable member is retried (nothing of it was written: the log append
    is its last step, and the channel has one writer)."""

    def __init__(self, producer: Producer, infos: list[CollectionInfo], rows: int = 40) -> None:
        super().__init__(daemon=True)
        self.producer, self.infos, self.rows = producer, infos, rows
        self.produced = {info.name: Produced() for info in infos}
        self.retries = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def _call(self, call: Callable[[], object]) -> None:
        while True:
            try:
                call()
                return
            except MetaUnavailableError:
                self.retries += 1
                time.sleep(0.1)

    def run(self) -> None:
        pk = 1
        try:
            while not self._halt.is_set():
                for info in self.infos:
                    rows = generate_rows(SCHEMA, self.rows, start_pk=pk, seed=pk)
                    self._call(partial(self.producer.insert, info.name, rows))
                    self.produced[info.name].rows.append(rows)
                    deleted = [pk, pk + 1]
                    self._call(partial(self.producer.delete, info.name, deleted, partition="_default"))
                    self.produced[info.name].deleted.extend(deleted)
                    pk += self.rows
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc

    def while_alive(self, condition: Callable[[], object]) -> Callable[[], object]:
        """`condition`, failing at once if the producer died (the checkpoints would stop
        advancing, and the wait would time out with the cause hidden)."""

        def check() -> object:
            if self.error is not None:
                raise AssertionError(f"producer failed: {self.error!r}") from self.error
            return condition()

        return check

    def stop(self) -> None:
        self._halt.set()
        self.join(60)
        assert self.error is None, f"producer failed: {self.error!r}"


@pytest.fixture
def settings3(settings: Settings, etcd3: EtcdCluster) -> Settings:
    return replace(fast_settings(settings), etcd_endpoints=etcd3.endpoints)


@pytest.fixture
def store3(settings3: Settings) -> Iterator[MetaStore]:
    store = MetaStore.connect(settings3)
    yield store
    store.close()


@pytest.fixture
def cluster3(settings3: Settings, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(settings3, tmp_path, env_extra={"VCHAN_SESSION_TTL": "5"})
    yield c
    c.cleanup()


def _advanced(store: MetaStore, before: dict[str, MsgPosition | None]) -> Callable[[], object]:
    return tolerant(advanced(store, before))


def _member_used_by(etcd: EtcdCluster, role: Role) -> int:
    """An etcd member the process's client is connected to (its TCP connections). After a
    failover it may hold two: the gRPC channel to the member it left reconnects when that
    member comes back, though the client keeps using the new one; either will do here,
    where the point is that the member killed is the leader and one the process talks to."""
    ports = {m.client_port: i for i, m in enumerate(etcd.members)}
    used = {
        ports[c.raddr.port]
        for c in psutil.Process(role.pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
    }
    assert used, f"process {role.pid} is connected to no etcd member"
    return min(used)


def test_kill_9_of_the_etcd_leader_mid_sync_and_during_a_coordinator_election_loses_and_duplicates_nothing(
    etcd3: EtcdCluster, cluster3: Cluster, store3: MetaStore
) -> None:
    settings = cluster3.settings
    storage = Storage.from_settings(settings)
    producer = Producer(System(settings, store3, storage), seal_after_insert=False)
    infos = [producer.create_collection(f"c{i}", SCHEMA, num_channels=1) for i in range(4)]
    channels = [v for info in infos for v in info.vchannels]
    nodes = [cluster3.node() for _ in range(2)]
    coordinators = [cluster3.coordinator() for _ in range(2)]
    wait_until(lambda: owners(store3, channels), PATIENCE, "every channel watched")
    load = FailoverLoad(producer, infos)
    load.start()
    wait_until(lambda: all(checkpoint_of(store3, v) for v in channels), PATIENCE, "every channel synced once")

    # 1. The etcd leader dies while the nodes sync (every 0.5 s under this load). The
    # leadership is first moved to the member a DataNode talks to, so that one must fail over.
    first = _member_used_by(etcd3, nodes[0])
    etcd3.move_leader(first)
    before = checkpoints(store3, channels)
    etcd3.kill(first)
    etcd3.wait_healthy()  # the two others elect a leader
    wait_until(
        load.while_alive(_advanced(store3, before)),
        PATIENCE,
        "every channel synced again after the leader died",
    )
    etcd3.restart(first)

    # 2. The active coordinator dies, and the etcd leader dies while the standby campaigns.
    (active,) = [c for c in coordinators if "won the election" in c.log()]
    (standby,) = [c for c in coordinators if c is not active]
    active.kill9()
    second = _member_used_by(etcd3, standby)
    etcd3.move_leader(second)
    time.sleep(settings.session_ttl / 2)  # its election key is still there: the standby waits
    etcd3.kill(second)
    wait_until(lambda: "won the election" in standby.log(), PATIENCE, "the standby won the election")
    before = retrying(lambda: checkpoints(store3, channels))
    assert isinstance(before, dict)
    wait_until(
        load.while_alive(_advanced(store3, before)),
        PATIENCE,
        "every channel synced under the new coordinator",
    )
    etcd3.restart(second)

    load.stop()
    for info in infos:
        retrying(lambda info=info: producer.time_tick(info.name))
    wait_until(tolerant(lambda: all_synced(store3, storage, infos)), PATIENCE, "every channel caught up")
    for info in infos:
        assert_exactly_once(store3, storage, info, load.produced[info.name])
    assert all(role.process.poll() is None for role in [*nodes, standby]), "a process died on the way"


def test_an_append_lock_whose_release_failed_twice_does_not_block_its_own_client(
    etcd3: EtcdCluster, store3: MetaStore
) -> None:
    """The release of a hold fails on a dead member, and so does its retry at the next
    acquire (the client went back to that member once its retry pause was over); the
    lock is then taken through another member. The client must not wait on its own
    stale lock until the wait runs out (it did: the producer of the failover test stalled)."""
    used = etcd3.endpoints.index(store3.client.endpoint_in_use.netloc)
    etcd3.move_leader((used + 1) % len(etcd3.members))  # a follower dies: the others keep quorum
    heads = ChannelHeads(store3, ttl=30, wait=10)
    held = heads.acquire("v-stale")
    etcd3.kill(used)
    try:
        heads.release(held)  # fails: the lock stays, queued for a retry
        assert store3.client.endpoint_in_use.netloc == etcd3.endpoints[used]
        time.sleep(ENDPOINT_RETRY_SECONDS + 0.2)  # the dead member is tried again first
        again = heads.acquire("v-stale", wait=5)
        assert again.lock.value != held.lock.value
        heads.release(again)
        assert store3.get(store3.keys.wal_lock("v-stale")) is None
    finally:
        heads.close()
        etcd3.restart(used)
