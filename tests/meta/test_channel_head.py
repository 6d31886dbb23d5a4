"""The append lock and head of a channel in etcd (meta.channel_head), with real etcd leases."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from vchan_assets.meta.channel_head import (
    AppendLockLostError,
    AppendLockTimeoutError,
    ChannelHeads,
    HeldChannel,
)
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelHead

CH = "ch-0"


def test_a_channel_without_a_head_has_an_unknown_offset_until_committed(store: MetaStore) -> None:
    heads = ChannelHeads(store, ttl=5, wait=5)
    with heads.hold(CH) as held:
        assert held.head == ChannelHead(CH, next_offset=-1)
        held.commit(replace(held.head, next_offset=7, last_ts=70))
    assert heads.read(CH) == ChannelHead(CH, 7, 70)
    assert store.get(store.keys.wal_lock(CH)) is None  # released


def test_a_second_client_waits_for_the_lock_and_times_out_naming_the_holder(store: MetaStore) -> None:
    a, b = ChannelHeads(store, ttl=5, wait=5), ChannelHeads(store, ttl=5, wait=0.3)
    with a.hold(CH), pytest.raises(AppendLockTimeoutError, match=a.client):
        b.acquire(CH)
    with b.hold(CH) as held:  # free again
        assert held.head.vchannel == CH


def test_a_dead_holders_lock_expires_with_its_lease(store: MetaStore) -> None:
    dead, alive = ChannelHeads(store, ttl=1, wait=10), ChannelHeads(store, ttl=1, wait=10)
    dead.acquire(CH)  # and never refreshes, nor releases: as a killed process
    started = time.monotonic()

    with alive.hold(CH) as held:
        waited = time.monotonic() - started
        held.commit(replace(held.head, next_offset=1))
    assert 0.3 < waited < 8
    assert alive.read(CH) == ChannelHead(CH, 1)


def test_a_holder_whose_lock_was_lost_commits_nothing(store: MetaStore) -> None:
    slow, other = ChannelHeads(store, ttl=1, wait=10), ChannelHeads(store, ttl=5, wait=10)
    held = slow.acquire(CH)
    slow.close()  # its lease is gone (as after a pause longer than the TTL)
    with other.hold(CH) as theirs:
        theirs.commit(replace(theirs.head, next_offset=5))

    with pytest.raises(AppendLockLostError):
        held.commit(replace(held.head, next_offset=99), release=True)
    time.sleep(0.5)  # past a third of the TTL: check() asks etcd, and finds the lease gone
    with pytest.raises(AppendLockLostError):
        held.check()
    assert other.read(CH) == ChannelHead(CH, 5)


def test_a_lock_this_client_took_but_lost_track_of_does_not_block_it(store: MetaStore) -> None:
    """An acquire's transaction applied but its answer was lost (etcd timed out): the
    caller retries with a new token and finds its own lock, on the lease it keeps alive.
    It used to wait on it until the wait ran out (the failover test's producer stalled)."""
    heads = ChannelHeads(store, ttl=30, wait=3)
    lease = store.grant(30)
    keys = store.keys
    lost, _ = store.try_lock(keys.wal_lock(CH), f"{heads.client}:99".encode(), lease, keys.wal_head(CH))
    assert lost is not None
    with heads.hold(CH) as held:
        assert held.lock.value != lost.value
        held.commit(replace(held.head, next_offset=3))
    assert heads.read(CH) == ChannelHead(CH, 3)
    assert store.get(store.keys.wal_lock(CH)) is None


def test_two_threads_of_one_client_take_the_lock_in_turn(store: MetaStore) -> None:
    """A lock of this client that a hold still has open is not one to drop."""
    heads = ChannelHeads(store, ttl=30, wait=10)
    first = heads.acquire(CH)
    second: list[HeldChannel] = []
    waiter = threading.Thread(target=lambda: second.append(heads.acquire(CH)))
    waiter.start()
    waiter.join(1.0)
    assert not second, "the second thread took a lock the first still held"
    heads.release(first)
    waiter.join(10)
    assert second and second[0].lock.value != first.lock.value
    heads.release(second[0])
    assert store.get(store.keys.wal_lock(CH)) is None
