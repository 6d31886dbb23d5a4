"""ID allocator and timestamp oracle on etcd.

Both persist a high-water mark in etcd with compare-and-swap before handing out
anything at or below it, so values stay unique and monotonic across client restarts
and etcd restarts (the mark is durable). Several allocators may share one key: the CAS
serializes them. IDs are reserved in batches (a gap after a restart costs nothing);
timestamps are not reserved ahead at all, since a reserved window is time a restarted
process would have to skip (`TimestampOracle`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from vchan_assets.meta.codec import decode_dict, encode
from vchan_assets.meta.errors import CasConflictError, MalformedValueError
from vchan_assets.meta.store import KeyValue, MetaStore
from vchan_assets.model import LOGICAL_BITS, compose_ts, physical_ms

log = logging.getLogger(__name__)

# A mark further ahead of this machine's wall clock than this is reported (a warning at
# most every AHEAD_WARNING_EVERY seconds per process): timestamps follow it, not the clock.
AHEAD_TOLERANCE_MS = 500
AHEAD_WARNING_EVERY = 10.0


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


@dataclass(frozen=True)
class ClockMark:
    """The timestamp oracles' mark in etcd: the newest hybrid timestamp issued (0: none
    yet), whether it is stored in this version's format, whose bytes sort as the
    timestamps do (`encode_clock_mark`), and if not the version of the key as read."""

    last_ts: int
    version: int
    ordered: bool = True


def encode_clock_mark(last_ts: int) -> bytes:
    """The mark's value: JSON whose bytes sort as the timestamps do (the timestamp as a
    fixed-width string), so etcd can compare a new mark with the stored one."""
    return encode({"last_ts": f"{last_ts:020d}"})


# Every mark stored in this format is above it (0 is never issued); an earlier version's
# (digits only) is below.
_NO_MARK = encode_clock_mark(0)


def read_clock_mark(store: MetaStore, key: str | None = None) -> ClockMark:
    """The oracles' mark as etcd holds it now."""
    key = key or store.keys.tso()
    return _clock_mark(key, store.get(key))


def _clock_mark(key: str, kv: KeyValue | None) -> ClockMark:
    if kv is None:
        return ClockMark(0, 0, ordered=False)
    text = kv.value.strip()
    if text.isdigit():
        # Written by the window oracles of earlier versions: the end of the last window
        # persisted (physical ms, exclusive). Anything below it may have been issued.
        return ClockMark(max(compose_ts(int(text)) - 1, 0), kv.version, ordered=False)
    last = decode_dict(key, kv.value).get("last_ts")
    if not isinstance(last, str) or len(last) != 20 or not last.isdigit():
        raise MalformedValueError(key, f"expected a hybrid timestamp of 20 digits in last_ts, got {last!r}")
    return ClockMark(int(last), kv.version)


def timestamp_ceiling(store: MetaStore, key: str | None = None) -> int:
    """A hybrid timestamp at or above every one any oracle has issued so far: the mark (0
    when none has issued any)."""
    return read_clock_mark(store, key).last_ts


def now_ts(store: MetaStore) -> int:
    """ "Now" for a read, and the stamp of a change that reads must see exactly from some
    timestamp on (a compaction output's `ready_ts`): a timestamp from the oracles, so it is
    above every one issued before the call, by any process, and below every one issued
    after it. A message acknowledged before the call is at or before it; a message whose
    timestamp is taken after it is not; a read at it picks the same rows whenever it runs.
    The mark each store last saw is kept, so that this is one round trip, not two."""
    oracle = TimestampOracle(store, known=_seen_by.get(store))
    ts = oracle.now()
    _seen_by[store] = oracle.known
    return ts


_seen_by: weakref.WeakKeyDictionary[MetaStore, ClockMark | None] = weakref.WeakKeyDictionary()


class TimestampOracle:
    """Hybrid timestamps (physical ms << 18 | logical) on this machine's wall clock,
    strictly increasing across every oracle on the same etcd key (Milvus' RootCoord TSO,
    without a window).

    Every allocation moves the mark in etcd, the newest timestamp issued, with one
    compare-and-swap before it returns: a new timestamp is max(wall clock, mark + 1
    logical step), so it is above every one issued before it, by any process, and it is
    never ahead of the wall clock unless the mark is. The swap compares the stored mark
    with the new timestamp, not with the version this oracle last saw: oracles of other
    processes moving the mark meanwhile cost a second round trip only when they issued
    at or above it (in the same millisecond). Nothing is reserved ahead, so a
    process that starts (each `vchan produce` is one) has nothing to skip over: this costs
    one etcd round trip per allocation instead of a window's none (BENCHMARKS.md).

    A mark ahead of the wall clock (persisted by the window oracles of earlier versions,
    or issued on a machine whose clock runs ahead) is followed one logical step at a time
    and never extended, so the timestamps are back on the wall clock once it passes the
    mark; a warning says how far ahead it is. When etcd is unreachable, nothing is issued
    (`MetaUnavailableError`); the first timestamp after it is on the wall clock again.
    """

    def __init__(
        self,
        store: MetaStore,
        key: str | None = None,
        clock: Callable[[], float] = time.time,
        known: ClockMark | None = None,
    ) -> None:
        self.store = store
        self.key = key or store.keys.tso()
        self.clock = clock
        self.conflicts = 0  # allocations retried because another oracle moved the mark first
        self._mark = known  # as this oracle last wrote or read it (None: read it first)
        self._lock = threading.Lock()

    @property
    def known(self) -> ClockMark | None:
        """The mark as this oracle last wrote or read it (a stale one costs a retry only)."""
        return self._mark

    def now(self) -> int:
        return self.alloc(1)

    def alloc(self, count: int = 1, above: int = 0) -> int:
        """Reserve `count` consecutive timestamps, all above `above` (a timestamp the caller
        must follow, e.g. its channel's last); returns the last one."""
        if count <= 0 or count >= 1 << LOGICAL_BITS:
            raise ValueError(f"count must be in [1, {1 << LOGICAL_BITS})")
        with self._lock:
            mark = self._mark or read_clock_mark(self.store, self.key)
            while True:
                wall = compose_ts(int(self.clock() * 1000))
                first = max(wall, mark.last_ts + 1, above + 1)
                last = first + count - 1
                value = encode_clock_mark(last)
                if mark.ordered:  # written only if no timestamp at or above `first` was issued
                    below = encode_clock_mark(first)
                    written, found = self.store.raise_value(self.key, _NO_MARK, below, value)
                else:  # absent, or an earlier version's value: not comparable, compare its version
                    written, found = self.store.try_swap(self.key, mark.version, value)
                if written:
                    self._mark = ClockMark(last, 0)
                    if physical_ms(first) - physical_ms(wall) > AHEAD_TOLERANCE_MS:
                        _warn_ahead(self.key, physical_ms(first) - physical_ms(wall))
                    return last
                self.conflicts += 1
                mark = _clock_mark(self.key, found)


_last_warning = [-AHEAD_WARNING_EVERY]


def _warn_ahead(key: str, ahead_ms: int) -> None:
    if time.monotonic() - _last_warning[0] < AHEAD_WARNING_EVERY:
        return
    _last_warning[0] = time.monotonic()
    log.warning(
        "the timestamp mark at %s is %.1f s ahead of this machine's wall clock (persisted by an "
        "earlier version's oracle, or issued on a machine whose clock runs ahead): timestamps "
        "follow it one logical step at a time without extending it, and are back on the wall "
        "clock in %.1f s",
        key,
        ahead_ms / 1000,
        ahead_ms / 1000,
    )
