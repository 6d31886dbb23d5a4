"""The pipeline on an S3-compatible server process (moto) while the S3 endpoint goes down
mid-sync and comes back: a DataNode and a DataCoord process reach S3 through a TCP proxy
process, which is killed (every connection reset, new ones refused) while the node syncs
under a continuous load, and started again on the same port seconds later. moto keeps
objects in memory, so its own process cannot be the one restarted; the proxy is the
endpoint clients see."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from datacoord.helpers import Cluster, Load, all_synced, checkpoint_of, fast_settings, owners, wait_until
from datanode.helpers import SCHEMA, assert_exactly_once

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.meta.embedded import free_port
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer

from .helpers import PATIENCE, advanced, checkpoints

PROXY = Path(__file__).with_name("tcp_proxy.py")


class Endpoint:
    """The S3 endpoint the cluster uses: a proxy process in front of the moto server."""

    def __init__(self, target: str, log: Path) -> None:
        self.target_port = int(target.rsplit(":", 1)[1])
        self.port = free_port()
        self.log = log
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(PROXY), str(self.port), str(self.target_port)],
                stdout=subprocess.PIPE, stderr=out, text=True,
            )  # fmt: skip
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "listening"

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)


@pytest.fixture
def endpoint(s3_server: dict[str, str], tmp_path: Path) -> Iterator[Endpoint]:
    proxy = Endpoint(s3_server["endpoint"], tmp_path / "proxy.log")
    proxy.start()
    yield proxy
    if proxy.process is not None and proxy.process.poll() is None:
        proxy.kill()


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
    producer = Producer(store, storage, direct)
    infos = [producer.create_collection(f"s3out{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)]
    channels = list(infos[0].vchannels)
    cluster = Cluster(through_proxy, tmp_path)
    load = Load(producer, infos)
    try:
        node = cluster.node()
        cluster.coordinator()
        wait_until(lambda: owners(store, channels), PATIENCE, "the channels watched")
        load.start()
        wait_until(
            lambda: all(checkpoint_of(store, v) for v in channels), PATIENCE, "every channel synced once"
        )
        wait_until(lambda: "synced " in node.log(), PATIENCE, "a sync committed")

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
        producer.time_tick(infos[0].name)
        wait_until(lambda: all_synced(store, storage, infos), PATIENCE, "every channel caught up")
        assert node.process.poll() is None, "the node died during the outage"
        produced = load.produced[infos[0].name]
        assert_exactly_once(store, storage, infos[0], produced)
        # What an analyst reads through the catalog: every live row once.
        table = Catalog(store, storage, direct).read_collection(infos[0].name, with_vectors=False)
        live = set(produced.table["pk"].to_pylist()) - set(produced.deleted)
        assert sorted(table["pk"]) == sorted(live)
    finally:
        cluster.cleanup()
