"""The tests' one way to wait: poll a condition until it holds, and on timeout fail
saying what was awaited and what was last seen. Each wait is told to the recorders
registered with `on_wait` (`testing.wait_report`: how near its timeout each wait came)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class WaitTimeout(TimeoutError, AssertionError):
    """A condition a test waited for did not hold in time (a test failure)."""


@dataclass(frozen=True)
class Wait:
    """One `wait_until`: what it waited for, its timeout, the seconds it took, whether the
    condition held, and the test running it (pytest's `PYTEST_CURRENT_TEST`: node id and
    phase; "" outside a test)."""

    what: str
    timeout: float
    took: float
    held: bool
    test: str

    @property
    def share(self) -> float:
        """The share of its timeout the wait used (a timeout of 0: infinite)."""
        return self.took / self.timeout if self.timeout > 0 else float("inf")


_recorders: list[Callable[[Wait], None]] = []


def on_wait(recorder: Callable[[Wait], None]) -> Callable[[], None]:
    """Tell `recorder` every wait from now on; returns the call that stops it."""
    _recorders.append(recorder)
    return lambda: _recorders.remove(recorder)


def _told(what: str, timeout: float, took: float, held: bool) -> None:
    wait = Wait(what, timeout, round(took, 3), held, os.environ.get("PYTEST_CURRENT_TEST", ""))
    for recorder in list(_recorders):
        recorder(wait)


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.1,
    *,
    describe: Callable[[], object] | None = None,
) -> float:
    """Poll `predicate` until it returns something true; the seconds it took. On timeout,
    `WaitTimeout` names `what` and what was last seen: `describe()` when given, otherwise
    the predicate's last value."""
    started = time.monotonic()
    while not (last := predicate()):
        if (took := time.monotonic() - started) > timeout:
            _told(what, timeout, took, held=False)
            seen = describe() if describe is not None else repr(last)
            raise WaitTimeout(f"waited {timeout:g}s for {what}; last saw: {seen}")
        time.sleep(interval)
    took = time.monotonic() - started
    _told(what, timeout, took, held=True)
    return took


def wait_stopped(proc: subprocess.Popen[str], marker: Path, timeout: float = 120) -> None:
    """Wait until the child reached its `=stop` failpoint (marker written, state T); a
    child that never does is killed."""

    def stopped() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"child exited early: {proc.returncode} {proc.stderr.read() if proc.stderr else ''}"
            )
        if not marker.exists():
            return False
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "T"

    try:
        wait_until(stopped, timeout, "the child stopped at its failpoint", interval=0.05)
    except WaitTimeout:
        proc.send_signal(signal.SIGKILL)
        raise
