"""The tests' shared fixtures, a pytest plugin (tests/conftest.py loads it with
`pytest_plugins`): a real etcd server, real storage directories, real Spark, and the test's
`System`, `Producer` and collection on them.

Nothing here fakes a component: `etcd` is the etcd binary on a loopback port, storage is a
temporary directory (or a real S3-compatible server in the S3 tests).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.segment_cache import SegmentCache
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import Cluster, fast_settings
from vchan_assets.testing.steps import new_collection
from vchan_assets.wal.producer import Producer

# Every JVM the tests start compiles with C1 only and collects with the serial GC: Spark
# drivers (this process's, the `vchan` processes', the Spark Connect servers'), the standalone
# masters and workers, their executors and spark-class's launcher. `JDK_JAVA_OPTIONS` is read
# by every `java` launch (JDK 9+), where SPARK_SUBMIT_OPTS reached only the drivers: the
# standalone daemons take SPARK_DAEMON_JAVA_OPTS, which `SparkStandalone` does not pass on,
# and executors their driver's `spark.executor.extraJavaOptions`. A test's JVM lives seconds
# to minutes on tiny data: C2's compiler threads would spend the CPU a start needs on code
# that never gets hot (measured: 8.7-11.2 s of JVM CPU for a driver's start and first job,
# against 14.0-20.1 s with the defaults; the two standalone tests and the cluster demo 101
# CPU s against 136 with the drivers' flags only). Each launch prints "NOTE: Picked up
# JDK_JAVA_OPTIONS" on its stderr. Children inherit it with the environment; a
# JDK_JAVA_OPTIONS set by the caller wins.
os.environ.setdefault("JDK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One etcd server for the whole run; tests isolate themselves by key root.

    The tests' etcd servers skip fsync (`EmbeddedEtcd.unsafe_no_fsync`): every transaction of
    a run waited for its WAL's fsync (34,066 of them, 49 s in all, in one lane's server in
    CI), and a kill -9 of etcd, the worst a test does to it, loses nothing the page cache
    holds."""
    from vchan_assets.meta.segment_cache import stop_shared_segment_cache

    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd-shared"), unsafe_no_fsync=True).start()
    yield server
    stop_shared_segment_cache()  # the DataCoord sensor's, when a test evaluated it here
    server.stop()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd server of this test alone: for tests that restart, kill or compact it."""
    server = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True).start()
    yield server
    server.stop()


@pytest.fixture
def settings(etcd: EmbeddedEtcd, tmp_path: Path) -> Settings:
    """Settings of one test: its own key root and storage directory on the shared etcd."""
    return replace(
        Settings(),
        home=tmp_path / "home",
        root=f"test-{uuid.uuid4().hex[:12]}",
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(tmp_path / "storage"),
        etcd_timeout=5.0,
        sync_in_process_mb=0.0,  # tests of the Spark engine run on Spark, however small their data
        # GC keeps a dropped segment's files for the time-travel window too: tests of GC
        # shorten the drop tolerance, tests of reads in the past widen this.
        time_travel=0.001,
    )


def _new_root(meta: MetaStore) -> MetaStore:
    """A fresh root as the DataCoord's first tick leaves it: its per-vchannel segment index
    marked complete (vchannels are listed through it)."""
    SegmentMeta(meta).backfill_channel_index()
    return meta


@pytest.fixture
def store(settings: Settings) -> Iterator[MetaStore]:
    meta = _new_root(MetaStore.connect(settings))
    yield meta
    meta.close()


@pytest.fixture
def cached(settings: Settings) -> Iterator[MetaStore]:
    """A second client of the test's root, holding the segment cache (as `vchan datacoord`)."""
    meta = MetaStore.connect(settings)
    cache = SegmentCache(meta).start()
    assert cache.wait_loaded(30), "the segment cache never loaded"
    meta.segment_cache = cache
    yield meta
    cache.stop()
    meta.close()


@pytest.fixture
def storage(settings: Settings) -> Storage:
    """The test's own storage root (a temporary directory)."""
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    return storage


@pytest.fixture
def system(settings: Settings, store: MetaStore, storage: Storage) -> System:
    """The test's `System`: its settings, metastore and storage."""
    return System(settings, store, storage)


@pytest.fixture
def producer(system: System) -> Producer:
    return Producer(system)


@pytest.fixture
def channels() -> int:
    """How many vchannels `collection` has: 2, unless a module overrides this fixture."""
    return 2


@pytest.fixture
def collection(producer: Producer, channels: int) -> CollectionInfo:
    """A new collection of `harness.SCHEMA` with `channels` vchannels."""
    return new_collection(producer, channels=channels)


@pytest.fixture
def private_settings(settings: Settings, private_etcd: EmbeddedEtcd) -> Settings:
    """Settings of one test pointing at its private etcd server."""
    return replace(settings, etcd_endpoints=(private_etcd.endpoint,))


@pytest.fixture
def private_store(private_settings: Settings) -> Iterator[MetaStore]:
    meta = _new_root(MetaStore.connect(private_settings))
    yield meta
    meta.close()


@pytest.fixture
def cluster(settings: Settings, tmp_path: Path) -> Iterator[Cluster]:
    """`vchan datanode` / `vchan datacoord` processes of one test, with short timings
    (`harness.fast_settings`); killed at teardown."""
    c = Cluster(fast_settings(settings), tmp_path)
    yield c
    c.cleanup()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto's, as its own process on loopback) with one bucket.

    Yields {"endpoint": "http://127.0.0.1:PORT", "bucket": NAME}. Test credentials are set
    in os.environ for the session, where pyarrow's S3 filesystem reads them."""
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    import boto3

    from vchan_assets.meta.embedded import free_port

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probing by the AWS SDK
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    binary = Path(sys.executable).parent / "moto_server"
    command = [str(binary)] if binary.exists() else [sys.executable, "-m", "moto.server"]
    logfile = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(logfile, "wb") as out:
        process = subprocess.Popen(
            [*command, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start; see {logfile}") from None
                time.sleep(0.1)
        bucket = "vchan-test"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield {"endpoint": endpoint, "bucket": bucket}
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def spark_remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One long-lived local Spark Connect server for the session (what `vchan up` runs)."""
    from vchan_assets.deploy.spark_connect import LocalSparkConnect

    server = LocalSparkConnect(tmp_path_factory.mktemp("spark-connect"))
    url = server.start()
    yield url
    # Close the Connect clients first: a client left open keeps retrying its release calls
    # against the stopped server from non-daemon threads, and the test process never exits.
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    for session in {RemoteSparkSession.getActiveSession(), RemoteSparkSession._default_session}:
        if session is not None:
            session.stop()
    server.stop()
