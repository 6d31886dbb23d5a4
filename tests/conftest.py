"""Shared fixtures: a real etcd server, real storage directories, real Spark.

Nothing here fakes a component: `etcd` is the etcd binary on a loopback port,
storage is a temporary directory (or a real S3-compatible server in the S3 tests).
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
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

# Every Spark JVM the tests start (this process's, the `vchan` processes' and the Spark
# Connect servers': all are launched by spark-submit, which adds SPARK_SUBMIT_OPTS to the
# java command line) compiles with C1 only and collects with the serial GC. A test's JVM
# lives seconds to minutes on tiny data: C2's compiler threads would spend the CPU a start
# needs on code that never gets hot (measured: 8.7-11.2 s of JVM CPU for a start and a
# first job, against 14.0-20.1 s with the defaults). Children inherit it with the
# environment; a SPARK_SUBMIT_OPTS set by the caller wins.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One etcd server for the whole run; tests isolate themselves by key root."""
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd-shared")).start()
    yield server
    server.stop()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd server of this test alone: for tests that restart, kill or compact it."""
    server = EmbeddedEtcd(tmp_path / "etcd").start()
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


@pytest.fixture
def store(settings: Settings) -> Iterator[MetaStore]:
    meta = MetaStore.connect(settings)
    yield meta
    meta.close()


@pytest.fixture
def storage(settings: Settings) -> Storage:
    """The test's own storage root (a temporary directory)."""
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    return storage


@pytest.fixture
def producer(store: MetaStore, storage: Storage, settings: Settings) -> Producer:
    return Producer(System(settings, store, storage))


@pytest.fixture
def private_settings(settings: Settings, private_etcd: EmbeddedEtcd) -> Settings:
    """Settings of one test pointing at its private etcd server."""
    return replace(settings, etcd_endpoints=(private_etcd.endpoint,))


@pytest.fixture
def private_store(private_settings: Settings) -> Iterator[MetaStore]:
    meta = MetaStore.connect(private_settings)
    yield meta
    meta.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto's, as its own process on loopback) with one bucket.

    Yields {"endpoint": "http://127.0.0.1:PORT", "bucket": NAME}. Test credentials are set
    in os.environ for the session, where pyarrow's S3 filesystem reads them."""
    import os
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

    for session in {RemoteSparkSession.getActiveSession(), RemoteSparkSession._default_session} - {None}:
        session.stop()
    server.stop()


# --- the fast lane: the `integration` marker ----------------------------------------------
# `pytest -m "not integration"` (`make check`) runs the tests that need no live service. A test
# is `integration` when any fixture it uses, directly or through the fixtures those build on
# (pytest's fixture closure: `settings` brings `etcd`, `store` and `producer` bring `settings`),
# is one of LIVE_FIXTURES; when it lives in one of LIVE_DIRS; or when it is marked by hand
# (`pytestmark = pytest.mark.integration`: tests that start etcd, Spark or a `vchan` process
# themselves). Keyed on fixture names only, wherever the fixtures are defined.

import sys  # noqa: E402  (this section's own imports, whatever the fixtures above import)
from collections.abc import Generator  # noqa: E402

# Fixtures that start a service: an etcd server (the shared one, a test's own, a module's own
# with other flags, a cluster of three, one with TLS), a Spark JVM (a Spark Connect server, a
# standalone cluster), an S3 server, a Dagster instance, a child process of the test.
LIVE_FIXTURES = frozenset(
    {
        "etcd",
        "private_etcd",
        "small_etcd",
        "etcd3",
        "secure_etcd",
        "spark_remote",
        "spark_cluster",
        "s3_server",
        "instance",
        "spawn_node",
        "node_process",
    }
)
# Directories of tests that are live as a whole: the Dagster definitions run against a Spark
# Connect server, and the cluster tests start etcd clusters, Spark masters and S3 servers.
LIVE_DIRS = ("defs", "cluster")
_TESTS = Path(__file__).resolve().parent


def is_live(item: pytest.Item) -> bool:
    """Whether the test needs a live service, by its fixtures and its directory."""
    if not LIVE_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
        return True
    path = Path(item.path).resolve()
    return any(path.is_relative_to(_TESTS / name) for name in LIVE_DIRS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_live(item):
            item.add_marker(pytest.mark.integration)


# A test the marker missed fails loudly instead of passing slowly: `make check` makes etcd and
# Java unreachable (VCHAN_ETCD_BINARY and JAVA_HOME point nowhere, for the test's children too),
# and this audit hook refuses, in a test not marked `integration`, to start the CLI, etcd, Java,
# Spark or the S3 server as a process. Other children (`sleep`, `lint-imports`, a Python probe
# of an import's memory) are allowed.
LIVE_PROGRAMS = frozenset({"vchan", "etcd", "java", "spark-submit", "spark-class", "moto_server"})
LIVE_MODULES = ("vchan_assets", "moto")  # `python -m vchan_assets.cli`, `python -m moto.server`
_pure_test: list[str] = []  # the node id of the running test, when it is not `integration`


def live_command(executable: object, args: object) -> bool:
    """Whether a command line (subprocess.Popen's) starts a live service or the CLI."""
    argv = [str(a) for a in args] if isinstance(args, list | tuple) else str(args).split()
    programs = {Path(str(p)).name for p in (executable, *argv[:1]) if p is not None}
    if programs & LIVE_PROGRAMS:
        return True
    modules = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"]
    return any(m == live or m.startswith(f"{live}.") for m in modules for live in LIVE_MODULES)


def _refuse_live_children(event: str, args: tuple[object, ...]) -> None:
    if event == "subprocess.Popen" and _pure_test and live_command(args[0], args[1]):
        raise RuntimeError(
            f"{_pure_test[0]} starts {args[1]!r} but is not marked `integration`: request a live "
            "fixture (tests/conftest.py LIVE_FIXTURES) or mark it `pytest.mark.integration`"
        )


sys.addaudithook(_refuse_live_children)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    _pure_test[:] = [] if item.get_closest_marker("integration") else [item.nodeid]
    try:
        return (yield)
    finally:
        _pure_test.clear()
