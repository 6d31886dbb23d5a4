"""`vchan demo --cluster`: the demo on a cluster topology started on this machine, then
torn down: a 3-member etcd, a Spark standalone master with two workers, and an
S3-compatible server (moto's, its own process), all on loopback.

The demo itself is `demo.run_demo` unchanged; only its settings differ
(`VCHAN_ETCD_ENDPOINTS`, `VCHAN_SPARK_MASTER`, `VCHAN_STORAGE_URI=s3://...`), which is
how the same code runs on a real cluster. The sync's driver runs in this process; its
tasks run in the workers' executors.
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
from vchan_assets.demo.direct import DemoOptions, run_demo
from vchan_assets.deploy.etcd_cluster import EtcdCluster
from vchan_assets.deploy.s3_server import S3Server
from vchan_assets.deploy.spark_standalone import SparkStandalone

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
        table.add_row("demo: producer, Spark driver (this process)", str(os.getpid()), "-")
        return table

    def pids(self) -> list[int]:
        """Every process the topology started (for checks that teardown stopped them)."""
        pids = [m.process.pid for m in self.etcd.members if m.process is not None]
        pids += [w.pid for w in self.spark.started]
        pids += [p.pid for p in (self.spark.master, self.s3.process) if p is not None]
        return pids


@contextmanager
def cluster_topology(settings: Settings, home: Path, workers: int = 2) -> Iterator[ClusterTopology]:
    """Start etcd (3 members), Spark (master + `workers`) and S3 under `home`; stop them
    all on exit, whatever happened."""
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
        on_cluster = replace(
            settings,
            etcd_endpoints=etcd.endpoints,
            spark_master=spark.url,
            spark_remote=None,
            storage_uri=f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}",
            s3_endpoint=s3.endpoint,
        )
        yield ClusterTopology(etcd, spark, s3, on_cluster)


def run_cluster_demo(settings: Settings, options: DemoOptions, console: Console | None = None) -> int:
    console = console or Console(width=120)
    home = settings.home / "cluster-demo"
    console.print(f"starting a 3-member etcd, a Spark master with 2 workers and an S3 server under {home}")
    with cluster_topology(settings, home) as topology:
        console.print(topology.table())
        try:
            code = run_demo(topology.settings, replace(options, keep=False), console)
        finally:
            _stop_spark_session()  # the application ends before its workers do
        console.print("stopping the cluster")
    console.print("[bold]cluster stopped[/]")
    return code


def _stop_spark_session() -> None:
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is not None:
        session.stop()
