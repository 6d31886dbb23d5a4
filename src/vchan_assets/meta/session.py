"""Node sessions on etcd leases, and the DataCoord's active-standby election.

As in Milvus: a DataNode registers its session in etcd (`session/datanode/{nodeID}`,
attached to a lease it keeps alive); when it loses liveness it stops that node's work.
Liveness is lost when etcd says the lease is gone, or when no keep-alive succeeded for
longer than the TTL: then etcd may already have expired the lease and handed the node's
channels to another node, so the node must assume it is dead even if it was only paused
(SIGSTOP, a long GC, a partition). No zombie writer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vchan_assets.errors import DeclaredError
from vchan_assets.meta.errors import CasConflictError, MetaError, MetaUnavailableError, NotLeaderError
from vchan_assets.meta.store import Fence, KeyValue, MetaStore, Snapshot, Value
from vchan_assets.meta.watch import EventKind, PrefixWatcher, WatchEvent
from vchan_assets.model import NodeSession

log = logging.getLogger(__name__)


class SessionConflictError(DeclaredError, MetaError):
    """The session key is already held by another live process (the same node ID twice)."""

    key: str
    holder_lease: int

    def __str__(self) -> str:
        holder = f"lease {self.holder_lease}" if self.holder_lease else "a key without a lease"
        return (
            f"session {self.key} is already registered ({holder}): another process with this identity "
            "is alive, or its session has not expired yet"
        )


class SessionRefusedError(DeclaredError, MetaError):
    """A session's key is no longer the one it created (its lease was revoked or expired:
    the node was cut off): the session may not write it again, nor come back under it."""

    key: str
    lease_id: int

    def __str__(self) -> str:
        return (
            f"session {self.key} on lease {self.lease_id} is gone (cut off or expired): "
            "an old session cannot come back; start the node again under a new session"
        )


class Session:
    """A key attached to an etcd lease that a daemon thread keeps alive every ttl/3.

    `on_expired()` is called exactly once, from a session thread, when liveness is lost;
    the lease is then revoked (if etcd still has it) so the key disappears.
    `close()` stops the keep-alive and revokes the lease: the key disappears at once.
    """

    def __init__(
        self,
        store: MetaStore,
        key: str,
        value: Value,
        ttl: float,
        on_expired: Callable[[], None] | None = None,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"session ttl must be positive, got {ttl}")
        self.store = store
        self.key = key
        self.value = value
        self.ttl = ttl
        # etcd grants whole seconds (MetaStore.grant rounds): never believe in more than that.
        self.local_ttl = min(ttl, max(1, round(ttl)))
        self.on_expired = on_expired
        self.lease_id: int | None = None
        self.create_revision = 0  # of the key, when registered: the term of an election
        self.expiry_reason: str | None = None
        self.keepalive_failures = 0  # metric
        self._last_ok = 0.0  # monotonic time at which the last successful keep-alive was sent
        self._expired = False
        self._closed = False
        self._suspended = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @classmethod
    def for_datanode(
        cls,
        store: MetaStore,
        node: NodeSession,
        ttl: float,
        on_expired: Callable[[], None] | None = None,
    ) -> Session:
        return cls(store, store.keys.datanode_session(node.node_id), node, ttl, on_expired)

    # --- state ---------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Registered, and neither expired nor closed."""
        return self.lease_id is not None and not self._expired and not self._closed

    @property
    def expired(self) -> bool:
        return self._expired

    # --- lifecycle -----------------------------------------------------------------

    def register(self) -> Session:
        """Grant a lease, create the key on it, start the keep-alive.

        Refuses with SessionConflictError if the key exists (held by another live lease)."""
        if self.lease_id is not None or self._closed:
            raise MetaError(f"session {self.key} was already registered")
        sent = time.monotonic()
        lease_id = self.store.grant(self.ttl)
        try:
            self.create_revision = self.store.cas(self.key, 0, self.value, lease=lease_id)
        except CasConflictError:
            holder = self.store.get(self.key)
            self._revoke_quietly(lease_id)
            raise SessionConflictError(self.key, holder.lease if holder else 0) from None
        except MetaError:
            self._revoke_quietly(lease_id)
            raise
        self.lease_id = lease_id
        self._last_ok = sent
        for target, name in ((self._keepalive_loop, "keep-alive"), (self._watchdog_loop, "watchdog")):
            thread = threading.Thread(target=target, name=f"session {name} {self.key}", daemon=True)
            self._threads.append(thread)
            thread.start()
        log.info("session %s registered on lease %s (ttl %ss)", self.key, lease_id, self.ttl)
        return self

    def update(self, value: Value) -> None:
        """Rewrite the session's value (a state change), on its lease, only while the key is
        still the one this session created. A session whose key was removed (its lease
        revoked by the coordinator's stop timeout, or expired) is refused with
        SessionRefusedError: an old session never writes its key back."""
        if self.lease_id is None:
            raise MetaError(f"session {self.key} is not registered")
        if self._expired or self._closed:
            raise SessionRefusedError(self.key, self.lease_id)
        try:
            self.store.fenced(Fence(self.key, self.create_revision)).put(self.key, value, lease=self.lease_id)
        except NotLeaderError:
            raise SessionRefusedError(self.key, self.lease_id) from None
        except MetaUnavailableError:
            raise
        except MetaError as exc:  # etcd: "requested lease not found"
            log.warning("session %s: update refused: %s", self.key, exc)
            raise SessionRefusedError(self.key, self.lease_id) from exc
        self.value = value

    def suspend_keepalive(self) -> None:
        """Stop refreshing the lease without revoking it (tests and fault injection): the
        session expires in etcd after the TTL, and `on_expired` fires."""
        self._suspended = True

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease; the key disappears at once.

        Does not call `on_expired`. If etcd is unreachable the lease expires by itself."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            revoke = self.lease_id is not None and not self._expired
        self._stop.set()
        self._join()
        if revoke and self.lease_id is not None:
            try:
                self.store.revoke(self.lease_id)
            except MetaError as exc:  # unreachable, or the lease is already gone
                log.warning(
                    "session %s: could not revoke lease %s (%s); it expires in %ss",
                    self.key,
                    self.lease_id,
                    exc,
                    self.ttl,
                )
        log.info("session %s closed", self.key)

    def __enter__(self) -> Session:
        return self if self.lease_id is not None else self.register()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- threads -------------------------------------------------------------------

    def _keepalive_loop(self) -> None:
        interval = self.local_ttl / 3
        retry = self.local_ttl / 10
        wait = interval
        assert self.lease_id is not None
        while not self._stop.wait(wait):
            wait = interval
            if self._suspended:
                continue
            sent = time.monotonic()
            if self._silent_too_long(sent):
                return
            try:
                remaining = self.store.keepalive(self.lease_id)
            except MetaUnavailableError as exc:
                self.keepalive_failures += 1
                log.warning("session %s: keep-alive failed (%s)", self.key, exc)
                wait = retry
                continue
            if remaining <= 0:
                self._expire(f"etcd reports lease {self.lease_id} expired")
                return
            with self._lock:
                # A refresh sent after the deadline proves nothing: we may have been paused
                # while etcd expired the lease and another node took over.
                if sent - self._last_ok <= self.local_ttl:
                    self._last_ok = sent

    def _watchdog_loop(self) -> None:
        while True:
            with self._lock:
                silent = time.monotonic() - self._last_ok
            if silent >= self.local_ttl:
                self._expire(f"no successful keep-alive for {silent:.1f}s (ttl {self.local_ttl}s)")
                return
            remaining = self.local_ttl - silent
            if self._stop.wait(remaining):
                return

    def _silent_too_long(self, now: float) -> bool:
        with self._lock:
            silent = now - self._last_ok
        if silent > self.local_ttl:
            self._expire(f"no successful keep-alive for {silent:.1f}s (ttl {self.local_ttl}s)")
            return True
        return False

    def _expire(self, reason: str) -> None:
        with self._lock:
            if self._expired or self._closed:
                return
            self._expired = True
            self.expiry_reason = reason
        self._stop.set()
        log.error("session %s lost liveness: %s", self.key, reason)
        if self.on_expired is not None:
            try:
                self.on_expired()
            except Exception:
                log.exception("on_expired of session %s failed", self.key)
        if self.lease_id is not None:
            # If etcd still has the lease (we only missed our own deadline), drop it so the
            # cluster sees what this process now believes: it is gone.
            self._revoke_quietly(self.lease_id)

    def _revoke_quietly(self, lease_id: int) -> None:
        try:
            self.store.revoke(lease_id)
        except MetaError as exc:
            # Already expired in etcd, or etcd unreachable: either way the lease dies with its TTL.
            log.info("session %s: revoke of lease %s failed: %s", self.key, lease_id, exc)

    def _join(self) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(self.store.client.timeout + 1)


class Election:
    """Active-standby election for the DataCoord on `session/datacoord` (one leader).

    The leader holds the key on its own session lease. A standby watches the key (etcd
    watch, with a poll every `poll_interval` as a safety net) until it is gone (the leader
    resigned, or its lease expired), then creates it with a compare-and-swap on version 0;
    exactly one contender wins each round. `on_lost()` is called if the leader's session
    loses liveness.
    """

    def __init__(
        self,
        store: MetaStore,
        value: Value,
        ttl: float,
        key: str | None = None,
        on_lost: Callable[[], None] | None = None,
        poll_interval: float | None = None,
    ) -> None:
        self.store = store
        self.value = value
        self.ttl = ttl
        self.key = key or store.keys.datacoord_session()
        self.on_lost = on_lost
        self.poll_interval = poll_interval if poll_interval is not None else min(2.0, ttl / 4)
        self._session: Session | None = None
        self._resigned = threading.Event()
        self._changed = threading.Event()  # the key changed (watch), or resign()
        self._resigning = threading.Lock()  # a resign returns once the seat is free

    @property
    def is_leader(self) -> bool:
        return self._session is not None and self._session.alive

    @property
    def session(self) -> Session | None:
        return self._session

    def fence(self) -> Fence | None:
        """This leader's term, to fence its writes with (None while not leading)."""
        session = self._session
        if session is None or not session.alive:
            return None
        return Fence(self.key, session.create_revision)

    def leader(self) -> KeyValue | None:
        """The current leader's key and value, or None if there is none."""
        return self.store.get(self.key)

    def try_acquire(self) -> bool:
        """One attempt: become the leader if nobody is. Returns whether this one leads."""
        if self.is_leader:
            return True
        if self.store.get(self.key) is not None:
            return False
        session = Session(self.store, self.key, self.value, self.ttl, on_expired=self._lost)
        try:
            session.register()
        except SessionConflictError:
            return False  # another standby won this round
        self._session = session
        log.info("%s: became the leader on lease %s", self.key, session.lease_id)
        return True

    def campaign(self, timeout: float | None = None) -> bool:
        """Wait until this contender leads (tries again as soon as the watch sees the key
        change, and every `poll_interval`); False on timeout or after `resign()`."""
        self._resigned.clear()
        deadline = None if timeout is None else time.monotonic() + timeout
        watcher = PrefixWatcher(self.store, self.key, on_event=self._on_change, on_relist=self._on_relist)
        with watcher:
            while True:
                self._changed.clear()
                try:
                    if self.try_acquire():
                        return True
                except MetaUnavailableError as exc:
                    log.warning("%s: campaign attempt failed (%s); retrying", self.key, exc)
                wait = self.poll_interval
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    wait = min(wait, remaining)
                self._changed.wait(wait)
                if self._resigned.is_set():
                    return False

    def _on_change(self, event: WatchEvent) -> None:
        if event.key == self.key and event.kind is EventKind.DELETE:
            self._changed.set()

    def _on_relist(self, snapshot: Snapshot) -> None:
        if all(kv.key != self.key for kv in snapshot.items):
            self._changed.set()

    def resign(self) -> None:
        """Give up leadership (revoke the session: a standby takes over at once), or stop
        campaigning. A resign called while another is revoking returns when that one has:
        a process that exits after its resign never leaves its key to the TTL."""
        self._resigned.set()
        self._changed.set()
        with self._resigning:
            session, self._session = self._session, None
            if session is not None:
                session.close()

    def _lost(self) -> None:
        log.error("%s: leadership lost", self.key)
        if self.on_lost is not None:
            self.on_lost()


@dataclass(frozen=True)
class Term:
    """A leader's term held by ticks rather than a keep-alive thread (a Dagster sensor):
    the etcd lease its election key lives on, and the fence of its writes."""

    lease_id: int
    fence: Fence


def hold_term(
    store: MetaStore, key: str, value: Value, ttl: float, term: Term | None
) -> tuple[Term | None, bool]:
    """One tick of a tick-hosted contender in the election on `key`: refresh `term`'s lease
    and keep leading while the key is still the one created for it; otherwise try to win
    (create the key on a fresh lease, CAS on version 0), exactly as `Election.try_acquire`.
    Returns (the term, or None while another contender leads; whether it is a new term).
    Liveness is the ticks: stop ticking and the lease expires after `ttl`."""
    if term is not None:
        try:
            alive = store.keepalive(term.lease_id) > 0
        except MetaUnavailableError:
            raise
        except MetaError:  # etcd no longer knows the lease
            alive = False
        held = store.get(key)
        if alive and held is not None and held.create_revision == term.fence.create_revision:
            return term, False
    if store.get(key) is not None:
        return None, False
    lease_id = store.grant(ttl)
    try:
        revision = store.cas(key, 0, value, lease=lease_id)
    except CasConflictError:
        store.revoke(lease_id)
        return None, False
    log.info("%s: became the leader on lease %s (tick-hosted)", key, lease_id)
    return Term(lease_id, Fence(key, revision)), True
