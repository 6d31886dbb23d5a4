"""Optimistic writes: read, change, compare-and-swap; on a lost race read again.

`retry_on_conflict(what, attempt)` calls `attempt` until it returns without a
`CasConflictError`, and raises `RetriesExhaustedError` (naming `what` and the last
conflict) when every attempt lost. Each attempt must read what it changes afresh.

`retry_transient(what, attempt, timeout)` is the client side of an unavailable etcd
or storage: the same call again, with backoff, until it answers or the timeout ends.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from vchan_assets.meta.errors import CasConflictError, MetaUnavailableError, RetriesExhaustedError

log = logging.getLogger(__name__)

T = TypeVar("T")

CAS_ATTEMPTS = 50


def retry_on_conflict(
    what: str,
    attempt: Callable[[], T],
    attempts: int = CAS_ATTEMPTS,
    on_conflict: Callable[[CasConflictError], None] | None = None,
) -> T:
    """`attempt()`'s result, retried after each CasConflictError; `on_conflict` runs
    between attempts (to re-read state the attempt depends on)."""
    last: CasConflictError | None = None
    for _ in range(attempts):
        try:
            return attempt()
        except CasConflictError as exc:
            last = exc
            log.info("%s: %s; re-reading", what, exc)
            if on_conflict is not None:
                on_conflict(exc)
    assert last is not None, "attempts must be positive"
    raise RetriesExhaustedError(what, attempts, last)


def retry_transient(
    what: str,
    attempt: Callable[[], T],
    timeout: float,
    transient: tuple[type[BaseException], ...] = (MetaUnavailableError,),
    first_pause: float = 0.05,
    max_pause: float = 1.0,
) -> T:
    """`attempt()`'s result, retried with exponential backoff (and jitter, so clients
    that lost etcd together do not come back together) while it raises one of
    `transient`; after `timeout` seconds the last error is raised as it is, so the
    caller sees the same clear message as without retries. `attempt` must be safe to
    repeat: a call whose answer was lost may have taken effect."""
    deadline = time.monotonic() + timeout
    pause = first_pause
    while True:
        try:
            return attempt()
        except transient as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            log.warning("%s: %s; retrying for %.0fs more", what, exc, left)
            time.sleep(min(pause * (0.5 + random.random()), left))
            pause = min(pause * 2, max_pause)
