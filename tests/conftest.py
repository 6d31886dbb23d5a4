"""The tests' fixtures (`etcd`, `settings`, `store`, `storage`, `system`, `producer`,
`collection`, `private_etcd`, `s3_server`, `spark_remote`, ...) are those of the pytest
plugin `vchan_assets.testing.fixtures`; the steps they share are in `vchan_assets.testing`."""

from __future__ import annotations

import gc
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

pytest_plugins = [
    "vchan_assets.testing.fixtures",
    "vchan_assets.testing.cpu_report",
    "vchan_assets.testing.wait_report",
]


# --- the fast lane: the `integration` marker ----------------------------------------------
# `pytest -m "not integration"` (`make check`) runs the tests that need no live service. A test
# is `integration` when any fixture it uses, directly or through the fixtures those build on
# (pytest's fixture closure: `settings` brings `etcd`, `store` and `producer` bring `settings`),
# is one of LIVE_FIXTURES; when it lives in one of LIVE_DIRS; or when it is marked by hand
# (`pytestmark = pytest.mark.integration`: tests that start etcd, Spark or a `vchan` process
# themselves). Keyed on fixture names only, wherever the fixtures are defined.


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


# A DataCoord freezes its decoded segment meta out of the garbage collector at its first
# reload (`gc.freeze`, datacoord/coordinator.py): in its own process, what it needs. In the
# tests' one process that would freeze every object of the earlier tests too, whose cycles
# would then never be collected: each test gives back what one froze.
@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
