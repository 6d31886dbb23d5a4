"""Optimistic writes: read, change, compare-and-swap; on a lost race read again.

`retry_on_conflict(what, attempt)` calls `attempt` until it returns without a
`CasConflictError`, and raises `RetriesExhaustedError` (naming `what` and the last
conflict) when every attempt lost. Each attempt must read what it changes afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from vchan_assets.meta.errors import CasConflictError, RetriesExhaustedError

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
