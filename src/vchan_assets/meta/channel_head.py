"""A channel's append lock and head in etcd: how many processes share one vchannel.

Two keys per vchannel (docs/multi-writer.md has the reasoning and the measured cost):

- `wal-lock/{vchannel}`: the append lock, a key attached to the holder's etcd lease, so a
  killed holder frees it when the lease expires (`VCHAN_APPEND_LOCK_TTL`);
- `wal-head/{vchannel}`: a `ChannelHead` (next offset, last timestamp, open segments),
  written only by the lock holder, in a transaction that also checks the lock is still
  the one it created.

One append is two round trips: `acquire` (create the lock key and read the head, one
transaction) and `HeldChannel.commit(..., release=True)` (new head and lock deletion,
one transaction). Everything that changes the head (appends, seals, flushes, drops)
holds the lock, so allocation and sealing of segments are serialized with the appends
that stamp timestamps: the head is the one allocation authority of its channel.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from vchan_assets.errors import DeclaredError
from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MetaError, MetaUnavailableError
from vchan_assets.meta.store import KeyValue, MetaStore, Value
from vchan_assets.model import ChannelHead

log = logging.getLogger(__name__)

# A holder publishes nothing once its lease may have less than this left (seconds, at
# most a quarter of the TTL): a holder paused past its lease must not write.
PUBLISH_MARGIN = 1.0
MAX_LOCK_POLL = 0.02  # seconds between two tries of a held lock, at most


class AppendLockTimeoutError(DeclaredError, MetaError):
    """The channel's append lock stayed held by another client for the whole wait."""

    vchannel: str
    waited: float
    holder: str | None

    def __str__(self) -> str:
        return (
            f"channel {self.vchannel}: the append lock was held by {self.holder or 'another client'} "
            f"for {self.waited:.1f}s; nothing was written"
        )


class AppendLockLostError(DeclaredError, MetaError):
    """This client's append lock expired or was taken over before it could commit."""

    vchannel: str
    what: str
    message = "channel {vchannel}: the append lock was lost before {what}"


@dataclass
class HeldChannel:
    """The append lock of one channel, held; `head` is the head as this holder sees it."""

    vchannel: str
    head: ChannelHead
    lock: KeyValue  # the lock key as this hold created it: its create revision fences the hold
    valid_until: float  # monotonic: the lease cannot expire before this
    store: MetaStore
    released: bool = False
    granted_at: float = field(default=0.0, repr=False)  # monotonic: last lease refresh
    lease_id: int = 0
    refresh: Callable[[], tuple[int, float, float]] | None = field(default=None, repr=False)

    def check(self, what: str = "publishing") -> None:
        """Raise AppendLockLostError unless the lease surely lives long enough to publish.
        A hold older than a third of the TTL (a big batch, a slow machine) refreshes the
        lease first: if the lease is still the same, the lock key is still there."""
        ttl = self.valid_until - self.granted_at
        if self.refresh is not None and time.monotonic() - self.granted_at > ttl / 3:
            lease_id, refreshed, ttl = self.refresh()
            if lease_id != self.lease_id:
                raise AppendLockLostError(self.vchannel, what)  # expired: the key went with it
            self.granted_at, self.valid_until = refreshed, refreshed + ttl
        margin = min(PUBLISH_MARGIN, ttl / 4)
        if time.monotonic() >= self.valid_until - margin:
            raise AppendLockLostError(self.vchannel, what)

    def commit(
        self,
        head: ChannelHead,
        puts: Mapping[str, Value] | None = None,
        release: bool = False,
    ) -> None:
        """Write `head` (and `puts`) if the lock is still this hold's; with `release`, the
        lock is deleted in the same transaction. AppendLockLostError otherwise."""
        writes: dict[str, Value] = {self.store.keys.wal_head(self.vchannel): head}
        writes.update(puts or {})
        deletes = [self.lock.key] if release else []
        if not self.store.locked_txn(self.lock, writes, deletes):
            raise AppendLockLostError(self.vchannel, "its commit")
        self.head = head
        self.released = release


class ChannelHeads:
    """This client's side of the append locks: one etcd lease for all its holds."""

    def __init__(self, store: MetaStore, ttl: float, wait: float) -> None:
        self.store = store
        self.ttl = ttl
        self.wait = wait
        self.client = uuid.uuid4().hex[:12]
        self.acquired = 0  # metrics
        self.waited_seconds = 0.0
        self._holds = itertools.count()
        self._lease_id: int | None = None
        self._refreshed = 0.0
        self._granted_ttl = 0.0
        self._lock = threading.Lock()
        self._unreleased: list[HeldChannel] = []  # releases that failed (etcd down): retried
        self._live: set[bytes] = set()  # the lock values of this client's holds not yet released

    # --- lease -----------------------------------------------------------------------------

    def _lease(self) -> tuple[int, float, float]:
        """(lease id, monotonic time it was last refreshed, ttl), refreshed every ttl/3."""
        with self._lock:
            now = time.monotonic()
            if self._lease_id is not None and now - self._refreshed > self._granted_ttl / 3:
                try:
                    left = self.store.keepalive(self._lease_id)
                except MetaUnavailableError:
                    raise
                except MetaError:
                    left = 0  # etcd no longer knows the lease
                if left > 0:
                    self._refreshed = now
                else:
                    self._lease_id = None
            if self._lease_id is None:
                self._lease_id = self.store.grant(self.ttl)
                self._granted_ttl = float(max(1, round(self.ttl)))
                self._refreshed = now
            return self._lease_id, self._refreshed, self._granted_ttl

    def close(self) -> None:
        """Revoke the lease (frees any lock a crashed thread of this client left)."""
        with self._lock:
            lease, self._lease_id = self._lease_id, None
        if lease is not None:
            with contextlib.suppress(MetaError):
                self.store.revoke(lease)

    # --- holds -----------------------------------------------------------------------------

    def acquire(
        self, vchannel: str, init: Callable[[], ChannelHead] | None = None, wait: float | None = None
    ) -> HeldChannel:
        """Wait for the lock (up to `wait` seconds), take it and read the head. A channel
        without a head gets `init()` (default: an empty head of unknown offset, -1)."""
        keys = self.store.keys
        lock_key, head_key = keys.wal_lock(vchannel), keys.wal_head(vchannel)
        token = f"{self.client}:{next(self._holds)}".encode()
        self._release_leftovers()
        with self._claiming(token):
            started = time.monotonic()
            pause = 0.001
            while True:
                lease_id, refreshed, ttl = self._lease()
                lock, head_kv = self.store.try_lock(lock_key, token, lease_id, head_key)
                if lock is not None and lock.value == token:  # ours (maybe from an answer lost before)
                    if head_kv is None:
                        head_kv = self.store.get(head_key)
                    break
                if lock is not None and self._orphaned(lock):
                    self._drop(lock)
                    continue
                waited = time.monotonic() - started
                if waited > (self.wait if wait is None else wait):
                    holder = lock.value.decode(errors="replace") if lock else None
                    raise AppendLockTimeoutError(vchannel, waited, holder)
                time.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, MAX_LOCK_POLL)
            self.acquired += 1
            self.waited_seconds += time.monotonic() - started
            if head_kv is not None:
                head = decode(head_key, head_kv.value, ChannelHead)
            else:
                head = init() if init else ChannelHead(vchannel, next_offset=-1)
        return HeldChannel(
            vchannel,
            head,
            lock,
            refreshed + ttl,
            self.store,
            granted_at=refreshed,
            lease_id=lease_id,
            refresh=self._lease,
        )

    def release(self, held: HeldChannel) -> None:
        """Delete the lock if it is still this hold's. A release that fails (etcd down) is
        retried before this client's next acquire: it is not left to the lease, which this
        client keeps alive as long as it runs."""
        with self._lock:
            self._live.discard(held.lock.value)
        if held.released:
            return
        held.released = True
        try:
            self.store.locked_txn(held.lock, {}, [held.lock.key])
        except MetaError as exc:
            log.warning("could not release the append lock of %s (%s); retrying later", held.vchannel, exc)
            with self._lock:
                self._unreleased.append(held)

    def _release_leftovers(self) -> None:
        with self._lock:
            leftovers, self._unreleased = self._unreleased, []
        for held in leftovers:
            held.released = False
            self.release(held)

    @contextlib.contextmanager
    def _claiming(self, token: bytes) -> Iterator[None]:
        """The token counts as held from its first lock attempt (another thread of this
        client must not drop the lock it may have just taken); an acquire that fails gives
        it up, so that a lock taken under it (an answer lost) is dropped by the next acquire."""
        with self._lock:
            self._live.add(token)
        try:
            yield
        except BaseException:
            with self._lock:
                self._live.discard(token)
            raise

    def _orphaned(self, lock: KeyValue) -> bool:
        """A lock this client took but holds no more: an acquire whose answer was lost (its
        caller retried with a new token), or a hold whose release failed. The client keeps
        its lease alive, so without this it would wait on its own lock until the wait ran out."""
        client, _, _ = lock.value.partition(b":")
        with self._lock:
            return client == self.client.encode() and lock.value not in self._live

    def _drop(self, lock: KeyValue) -> None:
        log.warning(
            "dropping the append lock %s that this client took but no longer holds",
            lock.value.decode(errors="replace"),
        )
        self.store.locked_txn(lock, {}, [lock.key])  # only that lock: its create revision

    @contextlib.contextmanager
    def hold(
        self, vchannel: str, init: Callable[[], ChannelHead] | None = None, wait: float | None = None
    ) -> Iterator[HeldChannel]:
        """The lock, held for the `with` block (AppendLockTimeoutError after `wait` seconds,
        default the client's; 0: one try)."""
        held = self.acquire(vchannel, init, wait)
        try:
            yield held
        finally:
            self.release(held)

    # --- reads without the lock ----------------------------------------------------------------

    def read(self, vchannel: str) -> ChannelHead | None:
        found = self.store.get_model(self.store.keys.wal_head(vchannel), ChannelHead)
        return None if found is None else found.model

    def all(self) -> list[ChannelHead]:
        found, _ = self.store.list_models(self.store.keys.wal_head.prefix, ChannelHead, skip_malformed=True)
        return [d.model for d in found]
