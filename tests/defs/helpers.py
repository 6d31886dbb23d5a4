"""Helpers shared by the Dagster-layer tests: the hosted node sensors, a sensor evaluation
against real etcd through Dagster's own context builder, and a live deployment (daemon and
webserver) on settings of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import yaml

from vchan_assets.config import Settings
from vchan_assets.defs.cluster.datacoord import datacoord_sensor
from vchan_assets.defs.cluster.datanodes import NodeCursor, datanode_sensor
from vchan_assets.defs.resources import VchanEnvResource, VchanResource
from vchan_assets.deploy.service import INSTANCE_CONFIG, DagsterService
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "s": "string"})

# Run monitoring fails a run whose process has not started within this many seconds
# (dagster.yaml): on a loaded machine a run's start takes up to that long.
RUN_START_TIMEOUT: int = yaml.safe_load(INSTANCE_CONFIG.read_text())["run_monitoring"][
    "start_timeout_seconds"
]


def after_a_run_start(work: float) -> float:
    """The bound of a wait for something a run must do: its start (up to run monitoring's
    start timeout), then `work` seconds."""
    return RUN_START_TIMEOUT + work


NODE1 = datanode_sensor("1", min_session_ttl=0)
NODE2 = datanode_sensor("2", min_session_ttl=0)


def sensor_resources(vchan: VchanResource) -> dict[str, object]:
    """The resources of a sensor evaluated on `vchan`'s settings."""
    return {"vchan_env": VchanEnvResource.from_settings(vchan.settings())}


def evaluate(
    sensor: dg.SensorDefinition, instance: dg.DagsterInstance, vchan: VchanResource, cursor: str | None = None
) -> dg.SensorResult:
    """One tick of `sensor` on `vchan`'s settings (given to it as its `vchan_env`)."""
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=sensor_resources(vchan))
    result = sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result


class CoordinatorTicks:
    """The DataCoord sensor evaluated tick after tick, its cursor (the term it holds in
    the election) carried from one tick to the next as the daemon does."""

    def __init__(self, instance: dg.DagsterInstance, vchan: VchanResource) -> None:
        self.instance = instance
        self.vchan = vchan
        self.cursor: str | None = None

    def tick(self) -> dg.SensorResult:
        result = evaluate(datacoord_sensor, self.instance, self.vchan, self.cursor)
        self.cursor = result.cursor
        return result


def skip_message(result: dg.SensorResult) -> str:
    return result.skip_reason.skip_message or "" if result.skip_reason else ""


def watched_by_a_dagster_node(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore
) -> tuple[NodeCursor, dict[str, ChannelWatchInfo]]:
    node = NodeCursor.parse(evaluate(NODE1, instance, vchan).cursor)
    CoordinatorTicks(instance, vchan).tick()
    evaluate(NODE1, instance, vchan, node.dump())
    found, _ = store.list_models(store.keys.channel_watch.under(node.node_id), ChannelWatchInfo)
    return node, {d.model.vchan.channel_name: d.model for d in found}


@contextmanager
def running(service: DagsterService) -> Iterator[tuple[str, MetaStore, Producer]]:
    """Start `service` (daemon + webserver) with a store and a producer on its settings;
    stop it (not the shared Spark Connect server) on exit."""
    store = MetaStore.connect(service.settings)
    try:
        url = service.start()
        storage = Storage.from_settings(service.settings)
        storage.ensure_root()
        yield url, store, Producer(System(service.settings, store, storage))
    finally:
        store.close()
        service.stop(stop_spark=False)


def live_settings(
    tmp: Path, prefix: str, etcd_endpoint: str, spark_remote: str, session_ttl: float
) -> Settings:
    """Settings of a live deployment under `tmp`: a root of its own in the shared etcd,
    syncs as soon as a row is 1 s old."""
    return Settings(
        home=tmp / "home",
        root=f"{prefix}-{uuid.uuid4().hex[:8]}",
        etcd_endpoints=(etcd_endpoint,),
        storage_uri=str(tmp / "storage"),
        spark_remote=spark_remote,
        session_ttl=session_ttl,
        sync_max_age=1.0,
    )
