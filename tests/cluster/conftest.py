"""Clusters on loopback, started once per module: a Spark standalone master with two
workers, a 3-member etcd (`cluster`, the `vchan` processes of a test, is a shared
fixture). Every process is stopped at teardown (and dies with the test run if it crashes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vchan_assets.deploy.etcd_cluster import EtcdCluster
from vchan_assets.deploy.spark_standalone import SparkStandalone


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkStandalone]:
    """A master and two workers of 1 core / 1 GB each."""
    cluster = SparkStandalone(tmp_path_factory.mktemp("spark-standalone"), workers=2, cores=1, memory="1g")
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Three etcd members on loopback."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd3"), size=3).start()
    yield cluster
    cluster.stop()
