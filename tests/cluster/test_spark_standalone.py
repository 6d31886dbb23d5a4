"""The sync on a Spark standalone cluster (a master and two worker JVMs on loopback),
directly and through a Spark Connect server that runs on that cluster."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.deploy.processes import descendants
from vchan_assets.deploy.spark_connect import LocalSparkConnect
from vchan_assets.deploy.spark_standalone import SparkStandalone
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    SCHEMA,
    Cluster,
    Produced,
    all_synced,
    owners,
    produce,
    read_deleted,
    read_inserted,
    segments,
)
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer

from .helpers import PATIENCE
from .spark_events import event_log_conf, python_workers_under, read_event_logs

COLUMNS = ("pk", "n", "f", "s", "b", "vec")


def _fill(
    store: MetaStore, settings: Settings, shards: int, name: str = "c0"
) -> tuple[CollectionInfo, Produced]:
    producer = Producer(System(settings, store, Storage.from_settings(settings)))
    info = producer.create_collection(name, SCHEMA, num_channels=shards)
    produced = Produced()
    produce(producer, info.name, produced, 600, 1, deletes=7)
    produce(producer, info.name, produced, 400, 601, deletes=3)
    producer.time_tick(info.name)
    return info, produced


def _cluster_env(tmp: Path, spark: dict[str, str]) -> dict[str, str]:
    return {
        **event_log_conf(tmp / "spark-conf", tmp / "events"),
        "VCHAN_SPARK_DRIVER_MEMORY": "512m",
        "VCHAN_SESSION_TTL": "10",
        **spark,
    }


def _sync_on_cluster(
    cluster: Cluster, store: MetaStore, info: CollectionInfo, engine_env: dict[str, str]
) -> Cluster:
    cluster.env_extra.update(engine_env)
    node = cluster.node(engine="spark", poll=0.5)
    cluster.coordinator()
    wait_until(lambda: owners(store, list(info.vchannels)), PATIENCE, "the channels watched")
    storage = Storage.from_settings(cluster.settings)
    wait_until(
        lambda: all_synced(store, storage, [info]), PATIENCE, "the cluster DataNode synced every channel"
    )
    assert node.process.poll() is None, node.log()[-3000:]
    return cluster


def _shape(found: list[SegmentInfo]) -> list[tuple[int, str, str, int, int]]:
    """Segments as content: partition, level, state, rows, binlog files per group."""
    return sorted(
        (s.partition_id, s.level.value, s.state.value, s.num_rows, sum(len(g.logs) for g in s.binlogs))
        for s in found
    )


def _local_reference(settings: Settings, store: MetaStore, tmp: Path, info: CollectionInfo) -> tuple:
    """The same data synced by the local engine in this process, under another root."""
    ref_settings = replace(settings, root=settings.root + "-ref", storage_uri=str(tmp / "ref-storage"))
    ref_store = MetaStore.connect(ref_settings)
    try:
        ref_info, _ = _fill(ref_store, ref_settings, shards=len(info.vchannels))
        ref_storage = Storage.from_settings(ref_settings)
        for vchannel in ref_info.vchannels:
            lease = grant_channel_lease(ref_store, IdAllocator(ref_store), vchannel, node_id=0)
            SyncTask(
                System(ref_settings, ref_store, ref_storage), ref_info, vchannel, lease, engine="local"
            ).run()
        return (
            read_inserted(ref_store, ref_storage, ref_info),
            sorted(read_deleted(ref_store, ref_storage, ref_info)),
            _shape(segments(ref_store, ref_info)),
        )
    finally:
        ref_store.close()


def test_a_datanode_on_a_standalone_master_runs_its_tasks_in_both_workers_python_writes_what_a_local_run_writes_and_commits_once_when_a_worker_dies(
    spark_cluster: SparkStandalone, cluster: Cluster, store: MetaStore, tmp_path: Path
) -> None:
    """One DataNode application (a driver and an executor per worker take most of the
    time) serves two rounds: a plain sync, then a sync whose worker is killed mid-task."""
    info, produced = _fill(store, cluster.settings, shards=2)
    marker = tmp_path / "task-stopped"
    marker.write_text("disarmed")  # a *-once failpoint fires only where the marker is created
    env = _cluster_env(tmp_path, {"VCHAN_SPARK_MASTER": spark_cluster.url})
    env.update(VCHAN_FAILPOINT="task_written=stop-once", VCHAN_FAILPOINT_MARKER=str(marker))
    _sync_on_cluster(cluster, store, info, env)
    node, coordinator = cluster.roles
    # While the node's application runs, each worker JVM has an executor JVM with Python workers.
    for worker in spark_cluster.started:
        assert python_workers_under(worker.pid), f"no Python worker under Spark worker {worker.index}"
    # (The driver may start Python workers of its own, to plan the registered format("vchan")
    # data source: the event log at the end shows the sync jobs' tasks ran on the executors.)
    storage = Storage.from_settings(cluster.settings)
    assert_exactly_once(store, storage, info, produced)
    ref_rows, ref_deletes, ref_shape = _local_reference(cluster.settings, store, tmp_path, info)
    rows = read_inserted(store, storage, info).sort_by("pk")
    ref_rows = ref_rows.sort_by("pk")
    for column in COLUMNS:
        assert rows[column].equals(ref_rows[column]), f"column {column} differs from the local run's"
    assert sorted(read_deleted(store, storage, info)) == ref_deletes
    assert _shape(segments(store, info)) == ref_shape

    # Round two: a new channel, filled while the coordinator is paused so that it is
    # synced in one job; the first task to finish writing its files stops there, in its
    # worker's Python worker, and that worker dies.
    coordinator.signal(signal.SIGSTOP)
    try:
        info2, produced2 = _fill(store, cluster.settings, shards=1, name="killed")
        marker.unlink()  # armed
    finally:
        coordinator.signal(signal.SIGCONT)
    wait_until(marker.exists, PATIENCE, "a sync task stopped after writing its files")
    wait_until(lambda: len(marker.read_text().split()) == 2, PATIENCE, "the stopped task wrote its pid")
    stopped_pid = int(marker.read_text().split()[1])
    (victim,) = [w for w in spark_cluster.started if stopped_pid in descendants(w.pid)]
    spark_cluster.kill_worker(victim.index)  # the worker, its executor and Python workers

    wait_until(lambda: all_synced(store, storage, [info2]), PATIENCE, "the retried sync committed")
    (vchannel,) = info2.vchannels
    # The node logs a sync just after its commit: on a loaded machine the commit can be seen first.
    wait_until(lambda: f"synced {vchannel} " in node.log(), PATIENCE, "the node logged the retried sync")
    log = node.log()
    assert "Lost executor" in log, log[-3000:]  # the driver saw the worker's executor die
    # Spark re-ran the lost task on the other worker (a lost worker is not the task's
    # failure), or the job failed and the node's next sync retried it: one commit either way.
    assert log.count(f"synced {vchannel} ") == 1, log[-3000:]
    assert_exactly_once(store, storage, info2, produced2)
    checkpoint = store.get(store.keys.channel_checkpoint(vchannel))
    assert checkpoint is not None and checkpoint.version == 1, "the checkpoint was committed once"
    assert node.terminate() == 0

    # The driver JVM renames its event log when it stops, which can outlast the node.
    wait_until(lambda: read_event_logs(tmp_path / "events"), PATIENCE, "the driver's event log closed")
    (app,) = read_event_logs(tmp_path / "events")
    ran_on = app.executors_of_jobs("sync ")
    assert ran_on and "driver" not in ran_on
    assert app.worker_ports(ran_on) == {w.ui_port for w in spark_cluster.started}


def test_a_datanode_through_a_spark_connect_server_on_the_standalone_master_syncs_on_the_workers(
    spark_cluster: SparkStandalone,
    cluster: Cluster,
    store: MetaStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    info, produced = _fill(store, cluster.settings, shards=1)
    conf = event_log_conf(tmp_path / "spark-conf", tmp_path / "events")
    monkeypatch.setenv("SPARK_CONF_DIR", conf["SPARK_CONF_DIR"])  # read by the server's spark-submit
    server = LocalSparkConnect(tmp_path / "connect", master=spark_cluster.url, partitions=2)
    url = server.start()
    try:
        _sync_on_cluster(cluster, store, info, {"VCHAN_SPARK_REMOTE": url, "VCHAN_SESSION_TTL": "10"})
        assert cluster.roles[0].terminate() == 0
    finally:
        server.stop()
    assert_exactly_once(store, Storage.from_settings(cluster.settings), info, produced)
    wait_until(lambda: read_event_logs(tmp_path / "events"), PATIENCE, "the server's event log closed")
    (app,) = read_event_logs(tmp_path / "events")
    assert app.app_name == "vchan Spark Connect server"
    ran_on = {executor for _, executor in app.task_executor}
    assert ran_on and "driver" not in ran_on
    assert app.worker_ports(ran_on) <= {w.ui_port for w in spark_cluster.started}
