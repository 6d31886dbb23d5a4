"""Helpers of the metastore tests: real child node processes, calls across an etcd restart."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from vchan_assets.meta.errors import MetaUnavailableError

CHILD = Path(__file__).with_name("session_child.py")
T = TypeVar("T")


def through_reconnect(call: Callable[[], T], attempts: int = 50) -> T:
    """Call through a short reconnect window after an etcd restart."""
    for _ in range(attempts - 1):
        try:
            return call()
        except MetaUnavailableError:
            time.sleep(0.1)
    return call()


class ChildNode:
    """A real Python process running `session_child.py`."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def read_line(self, timeout: float) -> str:
        """The next line the child prints; fails the test if none comes in time."""
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                pytest.fail(f"child printed nothing within {timeout}s")
        line = self.process.stdout.readline()
        if not line:
            stderr = self.process.stderr.read() if self.process.stderr else ""
            pytest.fail(f"child exited with {self.process.wait()}: {stderr}")
        return line.strip()

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def cleanup(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
