"""ID allocator and timestamp oracle on etcd, allocating in batches.

Both persist a high-water mark in etcd with compare-and-swap before handing out
anything below it, so values stay unique and monotonic across client restarts
(a new client starts above the persisted mark) and etcd restarts (the mark is
durable). Several allocators may share one key: the CAS serializes them.
"""

from __future__ import annotations

import threading
import time

from vchan_assets.meta.errors import CasConflictError, MalformedValueError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import LOGICAL_BITS, compose_ts


def _read_mark(store: MetaStore, key: str) -> tuple[int, int]:
    kv = store.get(key)
    if kv is None:
        return 0, 0
    try:
        return int(kv.value), kv.version
    except ValueError:
        raise MalformedValueError(
            key, f"expected an integer high-water mark, got {kv.value[:40]!r}"
        ) from None


class IdAllocator:
    """Unique, increasing int64 IDs (segments, binlogs, channel leases, nodes)."""

    def __init__(self, store: MetaStore, batch: int = 1000, key: str | None = None) -> None:
        self.store = store
        self.key = key or store.keys.id_allocator()
        self.batch = batch
        self._next = 0
        self._end = 0  # exclusive
        self._lock = threading.Lock()

    def alloc(self, count: int = 1) -> int:
        """Reserve `count` consecutive IDs; returns the first."""
        if count <= 0:
            raise ValueError("count must be positive")
        with self._lock:
            if self._next + count > self._end:
                self._reserve(max(count, self.batch))
            first = self._next
            self._next += count
            return first

    def _reserve(self, size: int) -> None:
        while True:
            mark, version = _read_mark(self.store, self.key)
            # IDs start at 1: 0 means "none" in the model.
            start = max(mark, 1)
            try:
                self.store.cas(self.key, version, str(start + size).encode())
            except CasConflictError:
                continue  # another allocator moved the mark: read it again
            self._next, self._end = start, start + size
            return


def timestamp_ceiling(store: MetaStore, key: str | None = None) -> int:
    """A hybrid timestamp at or above every one any oracle has issued so far: below the
    window the oracles persisted last (0 when none has issued any)."""
    mark, _ = _read_mark(store, key or store.keys.tso())
    return compose_ts(mark) - 1 if mark else 0


def now_ts(store: MetaStore) -> int:
    """ "Now" for a read: at or above every timestamp issued so far, by any process (the
    timestamp oracles' persisted window), and at least the wall clock. Every message
    acknowledged before the call is at or before it. An oracle issues from a window it
    persisted ahead (3 s), so a message appended within that window after the call can
    still fall at or before it: to read exactly what one producer had written, read at the
    timestamp its append returned."""
    return max(compose_ts(int(time.time() * 1000)), timestamp_ceiling(store))


class TimestampOracle:
    """Hybrid timestamps (physical ms << 18 | logical), strictly increasing.

    A window of physical time (`window_ms`) is persisted ahead; timestamps are issued
    inside it without a round trip. A restarted oracle starts after the persisted
    window, so it never goes back even if the wall clock did.
    """

    def __init__(self, store: MetaStore, window_ms: int = 3000, key: str | None = None) -> None:
        self.store = store
        self.key = key or store.keys.tso()
        self.window_ms = window_ms
        self._last = 0
        self._limit = 0  # exclusive: physical ms persisted in etcd
        self._lock = threading.Lock()

    def now(self) -> int:
        return self.alloc(1)

    def alloc(self, count: int = 1) -> int:
        """Reserve `count` consecutive timestamps; returns the last one."""
        if count <= 0 or count >= 1 << LOGICAL_BITS:
            raise ValueError(f"count must be in [1, {1 << LOGICAL_BITS})")
        with self._lock:
            candidate = max(compose_ts(int(time.time() * 1000)), self._last + 1)
            last = candidate + count - 1
            if (last >> LOGICAL_BITS) >= self._limit:
                self._extend(last >> LOGICAL_BITS)
                candidate = max(candidate, compose_ts(self._floor))
                last = candidate + count - 1
            self._last = last
            return last

    def _extend(self, physical_needed: int) -> None:
        while True:
            mark, version = _read_mark(self.store, self.key)
            # Everything below the persisted mark may have been issued by an earlier oracle.
            self._floor = max(mark, self._limit)
            limit = max(physical_needed, mark) + self.window_ms
            try:
                self.store.cas(self.key, version, str(limit).encode())
            except CasConflictError:
                continue
            self._limit = limit
            return

    _floor = 0


def fresh_ts(store: MetaStore) -> int:
    """A timestamp above every `now_ts` any process has taken so far, and at or below
    every later one: the first of a new oracle, which persists a new window above the old
    ceiling. What a change that reads at T must see exactly from T on is stamped with it
    (a compaction output's `ready_ts`): a read before the stamp used an earlier T."""
    return TimestampOracle(store).now()
