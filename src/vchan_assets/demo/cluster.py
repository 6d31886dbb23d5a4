"""`vchan demo --cluster`: the demo on a cluster topology started on this machine, then
torn down: a 3-member etcd, a Spark standalone master with two workers, an
S3-compatible server (moto's, its own process) and a PostgreSQL server for the Dagster
instance, all on loopback.

The demo itself is `demo.run_demo` unchanged; only its settings differ
(`VCHAN_ETCD_ENDPOINTS`, `VCHAN_SPARK_MASTER`, `VCHAN_STORAGE_URI=s3://...`,
`VCHAN_DAGSTER_POSTGRES_URL`), which is how the same code runs on a real cluster. The
sync's driver runs in this process; its tasks run in the workers' executors. After the
demo, its channel checkpoints are recorded as materializations of `channel_checkpoints`
(one per vchannel partition) in the Dagster instance on PostgreSQL (`dagster.yaml` with
`storage: postgres:`, what `vchan up` writes on a cluster) and read back from it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.demo.direct import DemoOptions, run_demo
from vchan_assets.deploy.etcd_cluster import EtcdCluster
from vchan_assets.deploy.postgres import PostgresServer, postgres_storage
from vchan_assets.deploy.s3_server import S3Server
from vchan_assets.deploy.service import write_instance_config
from vchan_assets.deploy.spark_standalone import SparkStandalone
from vchan_assets.meta.store import MetaStore

BUCKET = "vchan-demo"
# moto accepts any credentials; a real S3 takes them from the usual AWS variables.
LOCAL_S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "vchan-demo",
    "AWS_SECRET_ACCESS_KEY": "vchan-demo",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class ClusterTopology:
    """The processes of the demo cluster and the settings that point at them."""

    etcd: EtcdCluster
    spark: SparkStandalone
    s3: S3Server
    postgres: PostgresServer
    settings: Settings

    def table(self) -> Table:
        table = Table(title="cluster on this machine")
        for column in ("process", "pid", "address"):
            table.add_column(column)
        for i, member in enumerate(self.etcd.members):
            pid = member.process.pid if member.process else "-"
            table.add_row(f"etcd member {i}", str(pid), member.endpoint)
        if self.spark.master is not None:
            table.add_row("Spark master", str(self.spark.master.pid), self.spark.url)
        for worker in self.spark.started:
            table.add_row(f"Spark worker {worker.index}", str(worker.pid), f"ui 127.0.0.1:{worker.ui_port}")
        if self.s3.process is not None:
            table.add_row("S3 server (moto)", str(self.s3.process.pid), self.s3.endpoint)
        if self.postgres.process is not None:
            address = f"127.0.0.1:{self.postgres.port}"
            table.add_row("PostgreSQL (Dagster instance)", str(self.postgres.process.pid), address)
        table.add_row("demo: producer, Spark driver (this process)", str(os.getpid()), "-")
        return table

    def pids(self) -> list[int]:
        """Every process the topology started (for checks that teardown stopped them)."""
        pids = [m.process.pid for m in self.etcd.members if m.process is not None]
        pids += [w.pid for w in self.spark.started]
        pids += [p.pid for p in (self.spark.master, self.s3.process, self.postgres.process) if p is not None]
        return pids


@contextmanager
def cluster_topology(settings: Settings, home: Path, workers: int = 2) -> Iterator[ClusterTopology]:
    """Start etcd (3 members), Spark (master + `workers`), S3 and PostgreSQL under `home`;
    stop them all on exit, whatever happened."""
    for key, value in LOCAL_S3_CREDENTIALS.items():
        os.environ.setdefault(key, value)  # pyarrow's S3 client and the executors read these
    with ExitStack() as stack:
        etcd = EtcdCluster(home / "etcd", size=3)
        stack.callback(etcd.stop)
        etcd.start()
        s3 = S3Server(home / "s3")
        stack.callback(s3.stop)
        s3.start()
        s3.create_bucket(BUCKET)
        spark = SparkStandalone(home / "spark", workers=workers, cores=1, memory="1g")
        stack.callback(spark.stop)
        spark.start()
        postgres = PostgresServer(home / "postgres")
        stack.callback(postgres.stop)
        postgres.start()
        on_cluster = replace(
            settings,
            etcd_endpoints=etcd.endpoints,
            spark_master=spark.url,
            spark_remote=None,
            storage_uri=f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}",
            s3_endpoint=s3.endpoint,
            dagster_postgres_url=postgres.url,
        )
        yield ClusterTopology(etcd, spark, s3, postgres, on_cluster)


def run_cluster_demo(settings: Settings, options: DemoOptions, console: Console | None = None) -> int:
    console = console or Console(width=120)
    home = settings.home / "cluster-demo"
    console.print(
        "starting a 3-member etcd, a Spark master with 2 workers, an S3 server and PostgreSQL "
        f"(the Dagster instance) under {home}"
    )
    with cluster_topology(settings, home) as topology:
        console.print(topology.table())
        try:
            code = run_demo(topology.settings, replace(options, keep=False), console)
        finally:
            _stop_spark_session()  # the application ends before its workers do
        if code == 0:
            recorded = record_checkpoints_in_dagster(topology.settings, home / "dagster")
            console.print(
                f"Dagster instance on PostgreSQL (127.0.0.1:{topology.postgres.port}): "
                f"{recorded} channel checkpoints recorded and read back"
            )
        console.print("stopping the cluster")
    console.print("[bold]cluster stopped[/]")
    return code


def record_checkpoints_in_dagster(settings: Settings, dagster_home: Path) -> int:
    """Record the checkpoint of every vchannel as a materialization of its
    `channel_checkpoints` partition in the Dagster instance on VCHAN_DAGSTER_POSTGRES_URL;
    the number of those partitions the instance then holds a materialization of."""
    import dagster as dg

    from vchan_assets.defs.partitions import VCHANNELS
    from vchan_assets.defs.sync.assets import CHANNEL_CHECKPOINTS

    assert settings.dagster_postgres_url is not None
    write_instance_config(dagster_home, postgres_storage(settings.dagster_postgres_url))
    store = MetaStore.connect(settings)
    try:
        vchannels = [v for info in CollectionRegistry(store).list() for v in info.vchannels]
        checkpoints = {v: found.model for v in vchannels if (found := channel_checkpoint(store, v))}
    finally:
        store.close()
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        instance.add_dynamic_partitions(VCHANNELS, list(checkpoints))
        for vchannel, position in checkpoints.items():
            metadata = {"checkpoint_offset": position.offset, "checkpoint_ts": position.timestamp}
            instance.report_runless_asset_event(
                dg.AssetMaterialization(CHANNEL_CHECKPOINTS.key, partition=vchannel, metadata=metadata)
            )
        materialized = instance.get_materialized_partitions(CHANNEL_CHECKPOINTS.key)
    return len(materialized & set(checkpoints))


def _stop_spark_session() -> None:
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is not None:
        session.stop()
