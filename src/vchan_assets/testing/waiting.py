"""The tests' one way to wait: poll a condition until it holds, and on timeout fail
saying what was awaited and what was last seen."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


class WaitTimeout(TimeoutError, AssertionError):
    """A condition a test waited for did not hold in time (a test failure)."""


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
        if time.monotonic() - started > timeout:
            seen = describe() if describe is not None else repr(last)
            raise WaitTimeout(f"waited {timeout:g}s for {what}; last saw: {seen}")
        time.sleep(interval)
    return time.monotonic() - started


def wait_stopped(proc: subprocess.Popen[str], marker: Path, timeout: float = 120) -> None:
    """Wait until the child reached its `=stop` failpoint (marker written, state T)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"child exited early: {proc.returncode} {proc.stderr.read() if proc.stderr else ''}"
            )
        if marker.exists():
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "T":
                    return
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    raise AssertionError("child never reached its failpoint")
