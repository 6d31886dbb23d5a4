"""Watching a prefix of etcd with revisions (Milvus' MEP 7: a DataNode watches
`channelwatch/{nodeID}/`).

Two ways to follow a prefix:

- `poll_changes(store, prefix, after_revision)`: a pull for Dagster sensors whose cursor
  is an etcd revision. It returns the events after the cursor and the new cursor, or, when
  the cursor is unknown or was compacted away, the whole listing to reconcile from.
- `PrefixWatcher`: a thread for long-running processes that lists the prefix, then
  streams events from the next revision, survives etcd restarts and compactions, and
  never delivers an event twice.

Both follow invariant 5 of docs/architecture.md: after start, or when the cursor was compacted, the caller
gets the full listing instead of trusting that it missed nothing.

How a batch of etcd watch events proves progress: while a watcher catches up, etcd sends
every event of the watched range between the start revision and its current revision
in one response whose header carries that current revision; only a catch-up of more than
`ETCD_WATCH_BATCH_MAX_REVS` distinct revisions is split. So a response whose header
revision is R and which is not a full batch says "everything up to R is here".
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import InitVar, dataclass, field
from typing import Any, TypeVar

import etcd3.events
import etcd3.exceptions
import etcd3.utils
import grpc

from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MetaError, MetaUnavailableError, RevisionCompactedError
from vchan_assets.meta.store import MetaStore, Snapshot, error_reason, is_compacted

log = logging.getLogger(__name__)

M = TypeVar("M")

# etcd's watchBatchMaxRevs (server/mvcc/watcher_group.go): a catch-up response holds the
# events of at most this many distinct revisions; the rest follows in later responses.
ETCD_WATCH_BATCH_MAX_REVS = 1000


class EventKind(enum.StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix, at revision `mod_revision`."""

    kind: EventKind
    key: str
    value: bytes  # empty for a delete
    version: int  # 0 for a delete
    mod_revision: int
    create_revision: int
    lease: int

    def decode(self, model: type[M]) -> M:
        """The value as `model`; MalformedValueError naming the key if it does not decode."""
        if self.kind is EventKind.DELETE:
            raise ValueError(f"delete event of {self.key} has no value")
        return decode(self.key, self.value, model)


@dataclass(frozen=True)
class Changes:
    """What changed under a prefix after a cursor.

    If `relisted`, the caller must reconcile from `snapshot` (every key under the prefix
    at `revision`) and `events` is empty; `reason` says why (no cursor yet, compacted,
    cursor ahead of the store)."""

    revision: int
    events: tuple[WatchEvent, ...] = ()
    relisted: bool = False
    snapshot: Snapshot | None = None
    reason: str = ""


def _event(raw: Any) -> WatchEvent:
    is_delete = isinstance(raw, etcd3.events.DeleteEvent)
    return WatchEvent(
        kind=EventKind.DELETE if is_delete else EventKind.PUT,
        key=raw.key.decode(),
        value=b"" if is_delete else bytes(raw.value),
        version=0 if is_delete else int(raw.version),
        mod_revision=int(raw.mod_revision),
        create_revision=int(raw.create_revision),
        lease=int(raw.lease),
    )


def _proven_revision(response: Any) -> int:
    """The revision up to which a watch response proves that every event has arrived."""
    revisions = {int(e.mod_revision) for e in response.events}
    if len(revisions) >= ETCD_WATCH_BATCH_MAX_REVS:
        return max(revisions)  # possibly a split catch-up: only its own events are certain
    return int(response.header.revision)


class _Compacted(Exception):
    """The cursor's revision is gone from etcd's history."""


@contextlib.contextmanager
def _etcd_call(store: MetaStore, operation: str) -> Iterator[None]:
    """Like MetaStore's own wrapper, but a compacted revision becomes `_Compacted`."""
    try:
        yield
    except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
        if is_compacted(exc):
            raise _Compacted(str(exc)) from exc
        raise MetaUnavailableError(store.endpoints, operation, error_reason(exc)) from exc


class _PrefixStream:
    """One etcd watch of a prefix from a start revision; responses land in a queue."""

    def __init__(self, store: MetaStore, prefix: str, start_revision: int) -> None:
        self.store = store
        self.prefix = prefix
        self.queue: queue.Queue[Any] = queue.Queue()
        # Keep the client's watcher (one gRPC stream) this watch lives on: after a failed call
        # the client starts a new one, and a cancel sent there would leave ours running.
        self.watcher = store.client.watcher
        with _etcd_call(store, f"watch {prefix} from revision {start_revision}"):
            self.watch_id = self.watcher.add_callback(
                prefix,
                self.queue.put,
                range_end=etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix)),
                start_revision=start_revision,
            )

    def next(self, timeout: float) -> Any:
        """The next response, None on timeout; raises what the stream reported."""
        try:
            item = self.queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if item is _WAKE:
            return None
        if isinstance(item, BaseException):
            if is_compacted(item):
                raise _Compacted(f"watch of {self.prefix}: revision compacted") from item
            raise MetaUnavailableError(
                self.store.endpoints, f"watch {self.prefix}", error_reason(item)
            ) from item
        if item is None:  # the client ends a stream that closed without an error this way
            raise MetaUnavailableError(self.store.endpoints, f"watch {self.prefix}", "watch stream closed")
        return item

    def wake(self) -> None:
        self.queue.put(_WAKE)

    def cancel(self) -> None:
        try:
            self.watcher.cancel(self.watch_id)
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            # The stream is already gone (etcd down): nothing left to cancel on the server.
            log.debug("cancel watch of %s: %s", self.prefix, error_reason(exc))


_WAKE = object()


# --- pull API (sensors) -------------------------------------------------------------------


def poll_changes(store: MetaStore, prefix: str, after_revision: int | None, settle: float = 0.3) -> Changes:
    """Changes under `prefix` after the cursor `after_revision`, and the next cursor.

    With no cursor (None or 0), a compacted one, or one ahead of the store, the result is
    `relisted` with the full `snapshot` (invariant 5). Otherwise the events come from an
    etcd watch started at `after_revision + 1` and cancelled once a response proves it has
    caught up with the current revision. If the listing shows no net change since the
    cursor, only a key created and deleted again in between could still produce events;
    the watch then waits `settle` seconds (etcd pushes catch-up events every 100 ms).

    Bounded: the wait for events shares the store's timeout, and each etcd call has it;
    an unreachable etcd raises MetaUnavailableError."""
    snapshot = store.list_prefix(prefix)
    current = snapshot.revision
    if not after_revision:
        return Changes(current, relisted=True, snapshot=snapshot, reason="no cursor")
    if after_revision > current:
        log.warning(
            "cursor %s of %s is ahead of etcd (revision %s): relisting", after_revision, prefix, current
        )
        return Changes(current, relisted=True, snapshot=snapshot, reason="cursor ahead of etcd")
    if after_revision == current:
        return Changes(current)
    try:
        return _collect(store, prefix, after_revision, snapshot, settle)
    except _Compacted:
        log.info("cursor %s of %s was compacted: relisting", after_revision, prefix)
        fresh = store.list_prefix(prefix)
        return Changes(fresh.revision, relisted=True, snapshot=fresh, reason="cursor compacted")


def _collect(store: MetaStore, prefix: str, after: int, snapshot: Snapshot, settle: float) -> Changes:
    current = snapshot.revision
    try:
        before = store.list_prefix(prefix, revision=after, keys_only=True)
    except RevisionCompactedError as exc:
        raise _Compacted(str(exc)) from exc
    keys_before = {kv.key for kv in before.items}
    keys_now = {kv.key for kv in snapshot.items}
    net_change = bool(keys_before - keys_now) or any(kv.mod_revision > after for kv in snapshot.items)

    deadline = time.monotonic() + store.client.timeout
    stream = _PrefixStream(store, prefix, after + 1)
    settled = time.monotonic() + settle
    events: list[WatchEvent] = []
    try:
        while True:
            # Without a visible net change and with nothing received, quiet for `settle` means
            # nothing happened; anything else waits for the proof (or the timeout).
            may_settle = not net_change and not events
            now = time.monotonic()
            if may_settle and now >= settled:
                return Changes(current)
            if now >= deadline:
                raise MetaUnavailableError(
                    store.endpoints,
                    f"watch {prefix} from revision {after + 1}",
                    f"no response reached revision {current} within {store.client.timeout}s",
                )
            response = stream.next((min(deadline, settled) if may_settle else deadline) - now)
            if response is None:
                continue
            events.extend(_event(e) for e in response.events)
            proven = _proven_revision(response)
            if proven >= current:
                return Changes(proven, tuple(events))
    finally:
        stream.cancel()


# --- push API (long-running processes) ------------------------------------------------------


@dataclass(eq=False, repr=False)
class PrefixWatcher:
    """Follows a prefix in a thread: `on_relist(snapshot)` at start and whenever the cursor
    was compacted, then `on_event(event)` for every change in revision order.

    Across etcd restarts and outages it reconnects with backoff (capped at `max_backoff`)
    and resumes at the last delivered revision + 1, so no event is missed or repeated.
    A callback that raises is logged with the key and counted in `callback_errors`; the
    watcher goes on. With `start_revision` (a cursor saved earlier) it resumes from there
    instead of listing, unless that revision was compacted.
    """

    store: MetaStore
    prefix: str
    on_event: Callable[[WatchEvent], None]
    on_relist: Callable[[Snapshot], None]
    start_revision: InitVar[int | None] = None
    max_backoff: float = 2.0
    probe_interval: float = 5.0
    # metrics
    relists: int = field(default=0, init=False)
    reconnects: int = field(default=0, init=False)
    callback_errors: int = field(default=0, init=False)
    events_delivered: int = field(default=0, init=False)

    def __post_init__(self, start_revision: int | None) -> None:
        self._revision = start_revision or 0
        self._need_relist = not start_revision
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._stream: _PrefixStream | None = None
        self._thread: threading.Thread | None = None

    @property
    def revision(self) -> int:
        """Every event up to this revision has been delivered (the resume cursor)."""
        return self._revision

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> PrefixWatcher:
        if self._thread is not None:
            raise MetaError(f"watcher of {self.prefix} already started")
        self._thread = threading.Thread(target=self._run, name=f"watch {self.prefix}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.store.client.timeout + 1 if timeout is None else timeout)

    def __enter__(self) -> PrefixWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, revision: int, timeout: float) -> bool:
        """Block until every event up to `revision` was delivered; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._revision < revision:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._progress.wait(remaining)
        return True

    # --- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if self._need_relist:
                    self._relist()
                self._follow()
                backoff = 0.1
            except _Compacted:
                log.info("watch of %s: revision %s was compacted, relisting", self.prefix, self._revision + 1)
                self._need_relist = True
            except MetaError as exc:
                self.reconnects += 1
                log.warning("watch of %s interrupted (%s); retrying in %.1fs", self.prefix, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff)
            except Exception:
                # A bug must not silently end the node's view of its channels: log it, go on.
                self.reconnects += 1
                log.exception("watch of %s failed; retrying in %.1fs", self.prefix, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff)

    def _relist(self) -> None:
        snapshot = self.store.list_prefix(self.prefix)
        self.relists += 1
        try:
            self.on_relist(snapshot)
        except Exception:
            self.callback_errors += 1
            log.exception("on_relist of %s failed at revision %s", self.prefix, snapshot.revision)
        self._need_relist = False
        self._advance(snapshot.revision, force=True)

    def _follow(self) -> None:
        """Watch from the cursor until stopped; raises on compaction or a broken stream."""
        current = self.store.revision()
        if current < self._revision:
            # etcd went back in time (restored from an older backup): the cursor means nothing.
            log.warning("etcd revision %s is below the cursor %s of %s", current, self._revision, self.prefix)
            raise _Compacted("cursor ahead of etcd")
        stream = _PrefixStream(self.store, self.prefix, self._revision + 1)
        self._stream = stream  # before the loop checks _stop, so stop() can always wake it
        try:
            while not self._stop.is_set():
                response = stream.next(self.probe_interval)
                if response is None:
                    if not self._stop.is_set():
                        self.store.revision()  # a silent stream: make sure etcd is still there
                    continue
                self._deliver(response)
        finally:
            self._stream = None
            stream.cancel()

    def _deliver(self, response: Any) -> None:
        for raw in response.events:
            event = _event(raw)
            if event.mod_revision <= self._revision:
                continue  # already delivered before a reconnect
            try:
                self.on_event(event)
            except Exception:
                self.callback_errors += 1
                log.exception(
                    "on_event of %s failed for %s %s at revision %s",
                    self.prefix,
                    event.kind,
                    event.key,
                    event.mod_revision,
                )
            self.events_delivered += 1
        self._advance(_proven_revision(response))

    def _advance(self, revision: int, force: bool = False) -> None:
        with self._progress:
            if force or revision > self._revision:
                self._revision = revision
            self._progress.notify_all()
