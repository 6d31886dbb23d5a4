"""The etcd sensors, evaluated with Dagster's build_sensor_context against a real etcd."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import dagster as dg
import pytest

from vchan_assets.config import Settings
from vchan_assets.defs.cluster.datanodes import DAGSTER_ADDRESS, NodeCursor
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.sync.jobs import CHANNEL_TAG, NODE_TAG
from vchan_assets.defs.sync.sensor import sync_sensor
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, CollectionInfo, NodeSession, WatchState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import NODE1, NODE2, SCHEMA, CoordinatorTicks, evaluate, skip_message


@pytest.fixture
def vchan(dsettings: Settings) -> VchanResource:
    """Nodes without sync loops (VCHAN_DAGSTER_SYNC_LOOP=0): these tests are about the watch
    and release runs and the sync sensor's runs; the loop requests are test_sync_loop.py's."""
    return VchanResource.from_settings(replace(dsettings, dagster_sync_loop=0.0))


# Sensor-hosted nodes with the test's 2 s session TTL (no 60 s floor): expiry is quick.
def added_partitions(result: dg.SensorResult) -> list[str]:
    return [p for r in result.dynamic_partitions_requests or [] for p in r.partition_keys]  # type: ignore[union-attr]


def run_config(request: dg.RunRequest) -> dict[str, Any]:
    return request.run_config["ops"]["sync_vchannel"]["config"]


def watch_infos(store: MetaStore, node_id: int) -> dict[str, ChannelWatchInfo]:
    found, _ = store.list_models(store.keys.channel_watch.under(node_id), ChannelWatchInfo)
    return {d.model.vchan.channel_name: d.model for d in found}


def start_node(instance: dg.DagsterInstance, vchan: VchanResource, slot: str = "1") -> NodeCursor:
    result = evaluate((NODE1 if slot == "1" else NODE2), instance, vchan)
    assert result.cursor is not None
    return NodeCursor.parse(result.cursor)


def test_first_tick_registers_a_dagster_datanode_session(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore
) -> None:
    cursor = start_node(instance, vchan)
    session = store.get_model(store.keys.datanode_session(cursor.node_id), NodeSession)
    assert session is not None and session.model.address == f"{DAGSTER_ADDRESS}1"
    assert session.kv.lease == cursor.session_lease
    assert cursor.revision > 0


def test_next_tick_keeps_the_same_node_alive(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore
) -> None:
    first = start_node(instance, vchan)
    for _ in range(3):
        time.sleep(1.0)  # session TTL is 2 s: only the ticks keep it alive
        again = NodeCursor.parse(evaluate(NODE1, instance, vchan, first.dump()).cursor)
        assert again.node_id == first.node_id
    assert store.get(store.keys.datanode_session(first.node_id)) is not None


def test_to_watch_adds_the_partition_and_requests_the_first_sync_once(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, collection: CollectionInfo
) -> None:
    node = start_node(instance, vchan)
    CoordinatorTicks(instance, vchan).tick()  # assigns both channels (ToWatch) to the only node
    result = evaluate(NODE1, instance, vchan, node.dump())

    infos = watch_infos(store, node.node_id)
    assert {v: i.state for v, i in infos.items()} == dict.fromkeys(
        collection.vchannels, WatchState.WATCH_SUCCESS
    )
    assert sorted(added_partitions(result)) == sorted(collection.vchannels)
    requests = {r.partition_key: r for r in result.run_requests or []}
    assert sorted(requests) == sorted(collection.vchannels)
    for vchannel, request in requests.items():
        lease = infos[vchannel].lease_id
        assert request.run_key == f"watch:{node.node_id}:{vchannel}:{lease}"
        assert request.tags[CHANNEL_TAG] == vchannel and request.tags[NODE_TAG] == str(node.node_id)
        assert run_config(request)["lease_id"] == lease and not run_config(request)["release"]

    # Re-evaluated from the same cursor (a tick that crashed before saving it): the infos
    # are WatchSuccess now, so nothing is requested again.
    again = evaluate(NODE1, instance, vchan, node.dump())
    assert not again.run_requests
    # And from the new cursor: nothing changed.
    assert result.cursor is not None
    assert not evaluate(NODE1, instance, vchan, result.cursor).run_requests


def test_to_release_and_delete_request_release_runs_with_stable_keys(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, collection: CollectionInfo
) -> None:
    node = start_node(instance, vchan)
    CoordinatorTicks(instance, vchan).tick()
    watched = evaluate(NODE1, instance, vchan, node.dump())
    assert watched.cursor is not None
    first, second = collection.vchannels
    key = store.keys.channel_watch(node.node_id, first)
    kv = store.get(key)
    assert kv is not None
    info = watch_infos(store, node.node_id)[first]
    store.cas(key, kv.version, replace(info, state=WatchState.TO_RELEASE))
    store.delete(store.keys.channel_watch(node.node_id, second))

    result = evaluate(NODE1, instance, vchan, watched.cursor)
    requests = {r.partition_key: r for r in result.run_requests or []}
    assert sorted(requests) == sorted(collection.vchannels)
    assert run_config(requests[first])["release"] and run_config(requests[first])["watch_key"] == key
    assert run_config(requests[second])["release"] and run_config(requests[second])["watch_key"] == ""
    assert all(r.run_key and r.run_key.startswith(f"release:{node.node_id}:") for r in requests.values())

    again = evaluate(NODE1, instance, vchan, watched.cursor)
    assert sorted(r.run_key or "" for r in again.run_requests or []) == sorted(
        r.run_key or "" for r in requests.values()
    )


def test_compacted_cursor_relists_the_watch_prefix(
    instance: dg.DagsterInstance, dsettings: Settings, private_etcd: EmbeddedEtcd
) -> None:
    # A private etcd: compacting the shared one would disturb the other tests.
    private = replace(dsettings, etcd_endpoints=(private_etcd.endpoint,), dagster_sync_loop=0.0)
    vchan = VchanResource.from_settings(private)
    store = MetaStore.connect(private)
    producer = Producer(System(private, store, Storage.from_settings(private)))
    collection = producer.create_collection("compacted", SCHEMA, [], num_channels=2)
    node = start_node(instance, vchan)
    CoordinatorTicks(instance, vchan).tick()
    watched = evaluate(NODE1, instance, vchan, node.dump())
    stale = NodeCursor.parse(watched.cursor)
    # Move the store on and compact past the cursor (as etcd's auto-compaction would).
    for i in range(3):
        store.put(f"{store.keys.channel_watch.prefix}noise-{i}", b"{}")
    store.compact(store.revision())

    relisted = evaluate(NODE1, instance, vchan, stale.dump())
    assert relisted.cursor is not None and NodeCursor.parse(relisted.cursor).revision > stale.revision
    # The relist found both channels WatchSuccess: their partitions are (re)declared,
    # and nothing is requested again.
    assert sorted(added_partitions(relisted)) == sorted(collection.vchannels)
    assert not relisted.run_requests
    store.close()


def test_sync_sensor_requests_a_sync_per_channel_once_per_backlog(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    node = start_node(instance, vchan)
    CoordinatorTicks(instance, vchan).tick()
    watched = evaluate(NODE1, instance, vchan, node.dump())
    instance.add_dynamic_partitions("vchannels", list(collection.vchannels))
    # (No "nothing to sync yet" check here: the collection's DDL message is in the log, and on a
    # loaded machine it is past VCHAN_SYNC_MAX_AGE=1 s by now, a backlog like any other.)

    producer.insert(collection.name, generate_rows(SCHEMA, 500, start_pk=1, seed=1))
    time.sleep(1.1)  # VCHAN_SYNC_MAX_AGE=1 in these tests
    result = evaluate(sync_sensor, instance, vchan)
    requests = {r.partition_key: r for r in result.run_requests or []}
    assert sorted(requests) == sorted(collection.vchannels)
    infos = watch_infos(store, node.node_id)
    for vchannel, request in requests.items():
        assert request.run_key is not None and request.run_key.startswith(
            f"sync:{vchannel}:{infos[vchannel].lease_id}:"
        )
        assert run_config(request)["node_id"] == node.node_id
        assert "oldest unsynced row" in run_config(request)["reason"]
    again = evaluate(sync_sensor, instance, vchan)
    assert [r.run_key for r in again.run_requests or []] == [r.run_key for r in result.run_requests or []]
    assert watched.cursor


def test_datacoord_moves_the_channels_of_a_node_whose_sensor_stopped(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, collection: CollectionInfo
) -> None:
    one = start_node(instance, vchan, "1")
    two = start_node(instance, vchan, "2")
    coordinator = CoordinatorTicks(instance, vchan)
    coordinator.tick()
    one_cursor = evaluate(NODE1, instance, vchan, one.dump()).cursor
    two_cursor = evaluate(NODE2, instance, vchan, two.dump()).cursor
    assert len(watch_infos(store, one.node_id)) == 1 and len(watch_infos(store, two.node_id)) == 1

    # Kill node 1: its sensor stops ticking. Node 2 keeps ticking past node 1's TTL.
    deadline = time.monotonic() + 10
    while store.get(store.keys.datanode_session(one.node_id)) is not None:
        assert time.monotonic() < deadline, "node 1's session did not expire"
        two_cursor = evaluate(NODE2, instance, vchan, two_cursor).cursor
        time.sleep(0.5)
    coord = coordinator.tick()
    assert f"live nodes [{two.node_id}]" in skip_message(coord)
    result = evaluate(NODE2, instance, vchan, two_cursor)
    assert {v: i.state for v, i in watch_infos(store, two.node_id).items()} == dict.fromkeys(
        collection.vchannels, WatchState.WATCH_SUCCESS
    )
    assert not watch_infos(store, one.node_id)
    assert len(result.run_requests or []) == 1  # the first sync of the moved channel

    # Node 1's sensor starting again is a new node (ids are never reused).
    restarted = NodeCursor.parse(evaluate(NODE1, instance, vchan, one_cursor).cursor)
    assert restarted.node_id not in (one.node_id, two.node_id)


def test_a_sensor_cursor_round_trips_and_an_unreadable_one_starts_afresh() -> None:
    from vchan_assets.defs.cluster.datacoord import CoordinatorCursor

    coordinator = CoordinatorCursor(3, 4, 5, 6.5, (7, 8))
    assert CoordinatorCursor.parse(coordinator.dump()) == coordinator
    assert NodeCursor.parse(NodeCursor(1, 2, 3).dump()) == NodeCursor(1, 2, 3)
    for raw in (None, "", "{", "[1]", "null", '{"node_id": "1", "session_lease": 2, "revision": 3}'):
        assert NodeCursor.parse(raw) == NodeCursor()
    assert CoordinatorCursor.parse('{"server_id": 3, "seen": 7}') == CoordinatorCursor()
