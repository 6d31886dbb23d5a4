"""The pipeline on an S3-compatible server process (moto) while the S3 endpoint goes down
mid-sync and comes back: a DataNode and a DataCoord process reach S3 through a TCP proxy
process, which is killed (every connection reset, new ones refused) while the node syncs
under a continuous load, and started again on the same port seconds later. Then the
server process itself is killed -9 mid-sync and restarted: moto keeps objects in memory,
so S3Server(persist=True) logs every request and replays the log when it starts again."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.deploy.s3_server import S3Server
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    SCHEMA,
    Cluster,
    Load,
    PausableLoad,
    Produced,
    Role,
    all_synced,
    checkpoint_of,
    fast_settings,
    owners,
)
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.testing.tcp_proxy import Endpoint
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer

from .helpers import PATIENCE, advanced, checkpoints


@pytest.fixture
def endpoint(s3_server: dict[str, str], tmp_path: Path) -> Iterator[Endpoint]:
    proxy = Endpoint(s3_server["endpoint"], tmp_path / "proxy.log")
    proxy.start()
    yield proxy
    if proxy.process is not None and proxy.process.poll() is None:
        proxy.kill()


def _syncing(cluster: Cluster, store: MetaStore, channels: list[str], load: threading.Thread) -> Role:
    """A DataNode and a DataCoord process, the load started, every channel synced once."""
    node = cluster.node()
    cluster.coordinator()
    wait_until(lambda: owners(store, channels), PATIENCE, "the channels watched")
    load.start()
    wait_until(lambda: all(checkpoint_of(store, v) for v in channels), PATIENCE, "every channel synced once")
    wait_until(lambda: "synced " in node.log(), PATIENCE, "a sync committed")
    return node


def _caught_up_exactly_once(
    settings: Settings,
    store: MetaStore,
    storage: Storage,
    info: CollectionInfo,
    node: Role,
    produced: Produced,
) -> None:
    """After the load: every channel caught up, the node alive, every row and delete once
    in the binlogs, and what an analyst reads through the catalog: every live row once."""
    Producer(System(settings, store, storage)).time_tick(info.name)
    wait_until(lambda: all_synced(store, storage, [info]), PATIENCE, "every channel caught up")
    assert node.process.poll() is None, "the node died during the outage"
    assert_exactly_once(store, storage, info, produced)
    table = Catalog(System(settings, store, storage)).read_collection(info.name, with_vectors=False)
    assert sorted(table["pk"]) == sorted(set(produced.table["pk"].to_pylist()) - set(produced.deleted))


def test_the_s3_endpoint_down_mid_sync_and_back_loses_and_duplicates_nothing(
    settings: Settings, s3_server: dict[str, str], endpoint: Endpoint, store: MetaStore, tmp_path: Path
) -> None:
    direct = replace(
        fast_settings(settings),
        storage_uri=f"s3://{s3_server['bucket']}/{uuid.uuid4().hex[:8]}",
        s3_endpoint=s3_server["endpoint"],
    )
    through_proxy = replace(direct, s3_endpoint=endpoint.url)
    storage = Storage.from_settings(direct)  # the producer and the checks reach moto directly
    producer = Producer(System(direct, store, storage))
    infos = [producer.create_collection(f"s3out{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)]
    channels = list(infos[0].vchannels)
    cluster = Cluster(through_proxy, tmp_path)
    load = Load(producer, infos)
    try:
        node = _syncing(cluster, store, channels, load)

        endpoint.kill()  # the node is syncing every 0.5 s under the load
        outage_started = len(node.log())
        time.sleep(3)
        failed = node.log()[outage_started:]
        assert "sync of" in failed and "failed" in failed, failed[-3000:]
        before = checkpoints(store, channels)
        endpoint.start()
        wait_until(
            advanced(store, before), PATIENCE, "every channel synced again through the restarted endpoint"
        )
        load.stop()
        _caught_up_exactly_once(direct, store, storage, infos[0], node, load.produced[infos[0].name])
    finally:
        cluster.cleanup()


def test_the_s3_server_killed_mid_sync_and_restarted_loses_and_duplicates_nothing(
    settings: Settings,
    s3_server: dict[str, str],  # for its test credentials in the environment
    store: MetaStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The S3 server process itself (not a proxy) is killed -9 while a DataNode syncs under a
    continuous load, and started again on the same port; it gets back what it held by
    replaying its request log (S3Server(persist=True)). The node's syncs fail during the
    outage and go on after it; every row and delete lands exactly once."""
    # Whole request bodies with a Content-Length (not aws-chunked), so that moto's request
    # log holds them; every S3 client of this test and its processes is created after this.
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    server = S3Server(tmp_path / "s3", persist=True)
    server.start()
    try:
        server.create_bucket("restarted")
        direct = replace(
            fast_settings(settings),
            storage_uri=f"s3://restarted/{uuid.uuid4().hex[:8]}",
            s3_endpoint=server.endpoint,
        )
        storage = Storage.from_settings(direct)
        producer = Producer(System(direct, store, storage))
        infos = [producer.create_collection(f"s3srv{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)]
        channels = list(infos[0].vchannels)
        cluster = Cluster(direct, tmp_path)
        load = PausableLoad(producer, infos[0], period=0.05)
        try:
            node = _syncing(cluster, store, channels, load)

            load.pause()  # the producer writes to S3 too: no insert may end in doubt
            server.kill()
            outage_started = len(node.log())
            time.sleep(3)
            failed = node.log()[outage_started:]
            before = checkpoints(store, channels)
            server.start()  # same port; the objects come back from the request log
            load.resume()
            assert "sync of" in failed and "failed" in failed, failed[-3000:]
            wait_until(
                advanced(store, before), PATIENCE, "every channel synced again on the restarted server"
            )
            load.stop()
            _caught_up_exactly_once(direct, store, storage, infos[0], node, load.produced)
        finally:
            cluster.cleanup()
    finally:
        server.stop()
