"""The demo's last lines (`demo.direct.ending`, shared by the direct and the Dagster demo:
`vchan demo` used to end with the address of a Dagster UI it had just stopped) say what is
still running, looked up, not assumed: real child processes, one that exits when it is
stopped and one that stays. A whole `vchan demo` run (minutes on the 2-core CI machine) is
left to `make demo`."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from vchan_assets.demo.direct import DemoProcess, ending


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for child in made:
        child.kill()
        child.wait()


def _sleeper(children: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    child = subprocess.Popen(["sleep", "600"])
    children.append(child)
    return child


def test_without_keep_the_demo_ends_saying_everything_it_ran_has_stopped(
    children: list[subprocess.Popen[bytes]],
) -> None:
    etcd, spark = _sleeper(children), _sleeper(children)
    for child in (etcd, spark):  # what stopping the stack does to them
        child.terminate()
        child.wait()
    lines = ending(
        [DemoProcess("etcd at 127.0.0.1:1", etcd.pid), DemoProcess("spark", spark.pid)], stopping=True
    )
    assert lines == [
        "stopped:",
        f"  etcd at 127.0.0.1:1 (pid {etcd.pid})",
        f"  spark (pid {spark.pid})",
        "nothing the demo ran is left running",
    ]


def test_a_process_that_outlives_the_stop_is_named_as_still_running(
    children: list[subprocess.Popen[bytes]],
) -> None:
    """An etcd that ran before the demo is not stopped by it; the lines say so, and how to
    stop it, after the others had their time to exit."""
    gone, kept = _sleeper(children), _sleeper(children)
    gone.terminate()
    gone.wait()
    lines = ending([DemoProcess("spark", gone.pid), DemoProcess("etcd", kept.pid)], stopping=True, settle=0.2)
    assert lines == [
        "stopped:",
        f"  spark (pid {gone.pid})",
        "still running:",
        f"  etcd (pid {kept.pid})",
        "stop them with `vchan down`",
    ]
