"""Where a test run's CPU goes: a pytest plugin that charges each test the CPU seconds its
process tree spent while it ran (setup, call and teardown), children and JVMs included.

On a 2-core machine the suite is CPU-bound (two lanes keep the load at 10 and more), so a test's
wall time says little about what it costs the others: its CPU seconds do. Enabled by
`VCHAN_TEST_CPU=<directory>` (each lane of `make test` inherits it): each pytest process
writes its report there as `cpu-<pid>.json` (one record per test: node id, CPU and wall
seconds, with a module fixture's start charged to the first test that used it) and prints
the 25 costliest tests and modules at the end of the run.

The tree is the pytest process and its live descendants (`psutil`), each counted with the
children it already reaped; a process that was started and reaped within the test is in its
parent's children times. A process that left the tree (double-forked) is not counted.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Generator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import pytest

ENV = "VCHAN_TEST_CPU"
TOP = 25


def tree_cpu_seconds(root: psutil.Process) -> float:
    """The CPU seconds spent so far by `root` and its live descendants, each with the
    children it reaped."""
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended between the listing and the read
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclass(frozen=True)
class TestCost:
    """One test's CPU and wall seconds."""

    __test__ = False  # not a test class to pytest

    test: str
    cpu: float
    wall: float


class CpuReport:
    """The per-test CPU ledger of one pytest process."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"cpu-{os.getpid()}.json"
        self.root = psutil.Process(os.getpid())
        self.records: list[TestCost] = []

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        cpu, wall = tree_cpu_seconds(self.root), time.monotonic()
        try:
            return (yield)
        finally:
            spent = tree_cpu_seconds(self.root) - cpu
            self.records.append(TestCost(item.nodeid, round(spent, 2), round(time.monotonic() - wall, 2)))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps([asdict(r) for r in self.records], indent=1))
        write = terminalreporter.write_line
        total = sum(r.cpu for r in self.records)
        terminalreporter.section(f"CPU seconds by test ({total:.0f} s in all; {self.path})")
        for record in sorted(self.records, key=lambda r: -r.cpu)[:TOP]:
            write(f"{record.cpu:8.1f} cpu {record.wall:7.1f} wall  {record.test}")
        modules: dict[str, float] = defaultdict(float)
        for record in self.records:
            modules[record.test.split("::")[0]] += record.cpu
        terminalreporter.section("CPU seconds by module")
        for module, cpu in sorted(modules.items(), key=lambda m: -m[1])[:TOP]:
            write(f"{cpu:8.1f} cpu  {module}")


def pytest_configure(config: pytest.Config) -> None:
    if directory := os.environ.get(ENV):
        config.pluginmanager.register(CpuReport(Path(directory)), "vchan-cpu-report")
