"""Keeps the embedded services running: `vchan up --supervise`.

Every `interval` the supervisor asks which services are down (`missing()`) and, if any
are, heals (`heal()`: for the Dagster deployment, `DagsterService.start()`, which starts
only what is missing or dead). A heal that fails is retried after a delay that doubles
each time, up to `max_backoff`, so a service that cannot start (a broken config, a port
taken) does not spin; the first heal that succeeds resets it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Supervisor:
    missing: Callable[[], list[str]]
    heal: Callable[[], object]
    interval: float = 5.0
    backoff: float = 1.0
    max_backoff: float = 60.0
    restarts: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)  # (time, services)
    failures: int = 0  # consecutive failed heals

    def step(self) -> float:
        """One check (and heal if needed); returns how long to wait before the next."""
        down = self.missing()
        if not down:
            return self.interval
        log.warning("supervisor: %s down: restarting", ", ".join(down))
        try:
            self.heal()
        except Exception as exc:  # any failure to start is retried, never fatal
            self.failures += 1
            delay = min(self.max_backoff, self.backoff * 2 ** (self.failures - 1))
            log.error("supervisor: restarting %s failed (%s); next try in %.0fs", ", ".join(down), exc, delay)
            return delay
        self.failures = 0
        self.restarts.append((time.time(), tuple(down)))
        return self.interval

    def run(self, stop: threading.Event) -> None:
        """Check and heal until `stop` is set."""
        while not stop.wait(self.step()):
            pass
