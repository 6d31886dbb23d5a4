"""Read pins: a running read holds a horizon, and GC keeps every file it may open.

A read (the catalog's, or a Spark job's planning) puts `meta/read-pin/{pin}` (collection,
the read's timestamp T) on an etcd lease of VCHAN_READ_PIN_TTL *before* it lists segment
meta; the catalog revokes it when its read ends, a Spark job's pin expires with its lease
(nothing tells the planner when the job is done). A read at T opens segments that were
live at T, so any segment it may open was dropped at or after T (or not at all): GC does
not remove the files of a segment of a pinned collection dropped at or after the oldest
pinned T (`pinned_horizons`, `is_pinned`). A read that outlives its pin can find a file
gone: it then fails with `ReadPinLostError`, naming the pin and its TTL, not with a
missing-file error.

Searches share pins (`shared_pin`, VCHAN_READ_PIN_REUSE): a pin is three etcd round trips
(grant, put, revoke), a good part of a small search's cost. A search of a collection at T
takes the pin of an earlier search of the same collection in the same process when that
pin is at most `reuse` seconds old (min(VCHAN_READ_PIN_REUSE, VCHAN_READ_PIN_TTL / 2)) and
its timestamp is at or before T. The guarantee is the same: the search opens segments live
at T, dropped (if ever) at or after T, so at or after the pin's timestamp, which GC keeps;
its lease has at least TTL - reuse seconds left. A shared pin ends once it is `reuse`
seconds old and no search holds it (revoked then, by a timer or by its last search, and at
the process's exit); a killed process leaves it to its lease, as any pin.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from vchan_assets.config import Settings
from vchan_assets.errors import DeclaredError
from vchan_assets.meta.errors import MetaError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ReadPin, SegmentInfo, physical_ms
from vchan_assets.storage import StorageError

log = logging.getLogger(__name__)


class ReadPinLostError(DeclaredError, RuntimeError):
    """A read needed a file after its pin had expired, and the file was gone."""

    pin: int
    ttl: float
    path: str
    message = (
        "the read (pin {pin}) outlived its pin of {ttl:g}s (VCHAN_READ_PIN_TTL) and garbage "
        "collection removed {path}: read again"
    )


@dataclass(frozen=True)
class PinHandle:
    """A pin a read holds: its etcd lease, whose id names the pin's key."""

    lease_id: int
    ttl: float

    @property
    def pin_id(self) -> int:
        return self.lease_id

    def alive(self, store: MetaStore) -> bool:
        return store.get(store.keys.read_pin(self.pin_id)) is not None


def pin_read(store: MetaStore, settings: Settings, collection_id: int, as_of: int) -> PinHandle:
    """Pin what a read of `collection_id` at `as_of` may open, until the pin's lease
    expires (VCHAN_READ_PIN_TTL) or `unpin`. Call it before listing segment meta."""
    ttl = settings.read_pin_ttl
    lease_id = store.grant(ttl)  # unique in the cluster: it names the pin
    record = ReadPin(collection_id, as_of, socket.gethostname(), os.getpid(), time.time())
    store.put(store.keys.read_pin(lease_id), record, lease=lease_id)
    return PinHandle(lease_id, ttl)


def unpin(store: MetaStore, pin: PinHandle) -> None:
    """End the pin now (a pin that expired already, or an etcd that is down: its lease
    ends it anyway)."""
    try:
        store.revoke(pin.lease_id)
    except MetaError as exc:
        log.info("read pin %d: not revoked (%s); its lease ends it", pin.pin_id, exc)


@contextmanager
def pinned(store: MetaStore, settings: Settings, collection_id: int, as_of: int) -> Iterator[PinHandle]:
    """A pin for the duration of a read in this process."""
    pin = pin_read(store, settings, collection_id, as_of)
    try:
        yield pin
    finally:
        unpin(store, pin)


_Key = tuple[tuple[str, ...], str, int]  # (etcd endpoints, key root, collection id)


@dataclass(eq=False)
class _Shared:
    """A pin searches share: taken again while younger than the reuse window."""

    store: MetaStore
    key: _Key
    pin: PinHandle
    as_of: int
    taken: float  # time.monotonic() when granted
    users: int = 1
    ended: bool = False  # revoked (or being revoked): no search takes it any more


class SharedPins:
    """The read pins a process's searches share (module docstring): the newest per
    collection is taken again; each ends `reuse` seconds after it was taken, once no search
    holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest: dict[_Key, _Shared] = {}  # by collection: the pin a search may take
        self._live: set[_Shared] = set()
        atexit.register(self.close)

    @contextmanager
    def pinned(
        self, store: MetaStore, settings: Settings, collection_id: int, as_of: int
    ) -> Iterator[PinHandle]:
        """`pinned`, sharing the pin with the process's other searches of the collection."""
        reuse = min(settings.read_pin_reuse, settings.read_pin_ttl / 2)
        if reuse <= 0:
            with pinned(store, settings, collection_id, as_of) as pin:
                yield pin
            return
        key = (store.endpoints, store.keys.root, collection_id)
        with self._lock:
            shared = self._newest.get(key)
            if shared is not None and _reusable(shared, as_of, reuse):
                shared.users += 1
            else:
                shared = None
        if shared is None:
            pin = pin_read(store, settings, collection_id, as_of)
            shared = _Shared(store, key, pin, as_of, time.monotonic())
            with self._lock:
                self._newest[key] = shared  # the one before ends by its own timer or search
                self._live.add(shared)
            timer = threading.Timer(reuse, self._end_if_idle, (shared, reuse))
            timer.daemon = True
            timer.start()
        try:
            yield shared.pin
        finally:
            with self._lock:
                shared.users -= 1
            self._end_if_idle(shared, reuse)

    def _end_if_idle(self, shared: _Shared, reuse: float) -> None:
        """Revoke the pin once no search holds it and its window is over."""
        with self._lock:
            if shared.users or shared.ended or time.monotonic() - shared.taken < reuse:
                return
            self._forget(shared)
        _unpin_quietly(shared.store, shared.pin)

    def _forget(self, shared: _Shared) -> None:
        shared.ended = True
        self._live.discard(shared)
        if self._newest.get(shared.key) is shared:
            del self._newest[shared.key]

    def close(self) -> None:
        """End every shared pin no search holds (at exit: else its lease keeps it for its TTL)."""
        with self._lock:
            idle = [s for s in self._live if not s.users]
            for shared in idle:
                self._forget(shared)
        for shared in idle:
            _unpin_quietly(shared.store, shared.pin)


def _reusable(shared: _Shared, as_of: int, reuse: float) -> bool:
    """A search at `as_of` may take the pin: at or before its timestamp, and young."""
    return not shared.ended and shared.as_of <= as_of and time.monotonic() - shared.taken < reuse


def _unpin_quietly(store: MetaStore, pin: PinHandle) -> None:
    try:
        unpin(store, pin)
    except Exception as exc:  # a closed connection (grpc raises ValueError): its lease ends it
        log.info("read pin %d: not revoked (%s); its lease ends it", pin.pin_id, exc)


SHARED_PINS = SharedPins()


def shared_pin(
    store: MetaStore, settings: Settings, collection_id: int, as_of: int
) -> AbstractContextManager[PinHandle]:
    """A search's pin: `pinned`, shared with the process's other searches (`SharedPins`)."""
    return SHARED_PINS.pinned(store, settings, collection_id, as_of)


@contextmanager
def pin_or_lost(store: MetaStore, pin: PinHandle) -> Iterator[None]:
    """Turns a file that went missing under a read whose pin expired into
    `ReadPinLostError`; with the pin alive, the storage error stands."""
    try:
        yield
    except StorageError as exc:
        if pin.alive(store):
            raise
        raise ReadPinLostError(pin.pin_id, pin.ttl, exc.path) from exc


def pinned_horizons(store: MetaStore) -> dict[int, float]:
    """Collection id -> the oldest time (seconds) a live read of it may need segments from:
    its timestamp, or when it pinned if earlier (a read "now" may be a little ahead of the
    wall clock, and it lists segment meta after it pinned)."""
    found, _ = store.list_models(store.keys.read_pin.prefix, ReadPin, True)
    horizons: dict[int, float] = {}
    for d in found:
        at = min(physical_ms(d.model.as_of) / 1000, d.model.started_at)
        horizons[d.model.collection_id] = min(at, horizons.get(d.model.collection_id, at))
    return horizons


def is_pinned(seg: SegmentInfo, horizons: dict[int, float]) -> bool:
    """A running read may open the segment's files: it was dropped at or after the
    timestamp of a read of its collection (or its drop time is unknown)."""
    horizon = horizons.get(seg.collection_id)
    return horizon is not None and (seg.dropped_at is None or seg.dropped_at >= horizon - 1.0)
