"""How near its timeout each wait of a test run came: a pytest plugin that keeps every
`wait_until` of the run (`testing.waiting.on_wait`) and lists the waits that used the
largest share of their timeout. A wait that needs most of its budget on a quiet run is the
next flaky test on a loaded one: its timeout, or what it waits for, needs a look before it
fails in CI.

Enabled by `VCHAN_TEST_WAITS=<directory>` (each lane of `make test` inherits it): each pytest
process writes `waits-<pid>.json` there (one record per wait: what, timeout, seconds taken,
whether it held, the test and phase) and prints the 25 waits nearest their timeout at the end.
Only the waits of the pytest process itself are seen, not those of its child processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from vchan_assets.testing.waiting import Wait, on_wait

ENV = "VCHAN_TEST_WAITS"
TOP = 25


def nearest_timeout(waits: list[Wait], top: int = TOP) -> list[Wait]:
    """The `top` waits that used the largest share of their timeout, a timed-out one first."""
    return sorted(waits, key=lambda w: -w.share)[:top]


class WaitReport:
    """The waits of one pytest process."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"waits-{os.getpid()}.json"
        self.waits: list[Wait] = []
        self._stop = on_wait(self.waits.append)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps([asdict(w) for w in self.waits], indent=1))
        terminalreporter.section(f"Waits nearest their timeout ({len(self.waits)} waits; {self.path})")
        for wait in nearest_timeout(self.waits):
            state = "" if wait.held else "  TIMED OUT"
            terminalreporter.write_line(
                f"{wait.share:6.0%} {wait.took:7.1f}s of {wait.timeout:g}s{state}  {wait.what}  [{wait.test}]"
            )

    def pytest_unconfigure(self) -> None:
        self._stop()


def pytest_configure(config: pytest.Config) -> None:
    if directory := os.environ.get(ENV):
        config.pluginmanager.register(WaitReport(Path(directory)), "vchan-wait-report")
