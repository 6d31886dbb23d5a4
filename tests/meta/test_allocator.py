"""ID allocator and timestamp oracle: unique and monotonic across clients and restarts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.allocator import IdAllocator, TimestampOracle
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.errors import MalformedValueError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import physical_ms

from .helpers import through_reconnect


def _ids(allocator: IdAllocator, n: int) -> list[int]:
    return [allocator.alloc() for _ in range(n)]


# --- IdAllocator ------------------------------------------------------------------------


def test_ids_increase_and_never_repeat_within_one_allocator(store: MetaStore) -> None:
    ids = _ids(IdAllocator(store, batch=7), 50)

    assert ids == sorted(set(ids)) and ids[0] >= 1


def test_ids_continue_above_the_old_ones_after_a_client_restart(settings: Settings) -> None:
    first_store = MetaStore.connect(settings)
    before = _ids(IdAllocator(first_store, batch=10), 13)  # part of a batch stays unused
    first_store.close()

    second_store = MetaStore.connect(settings)
    after = _ids(IdAllocator(second_store, batch=10), 13)
    second_store.close()

    assert min(after) > max(before)


def test_ids_unique_when_the_first_request_fills_a_whole_batch(settings: Settings) -> None:
    stores = [MetaStore.connect(settings) for _ in range(2)]
    try:
        first = IdAllocator(stores[0], batch=10).alloc(10)
        second = IdAllocator(stores[1], batch=10).alloc(1)
    finally:
        for s in stores:
            s.close()

    assert second not in range(first, first + 10)


def test_block_allocation_returns_consecutive_ids_no_one_else_gets(store: MetaStore) -> None:
    allocator = IdAllocator(store, batch=4)
    block = allocator.alloc(10)

    later = _ids(allocator, 5)

    assert not set(range(block, block + 10)) & set(later)


def test_ids_continue_above_the_old_ones_after_an_etcd_restart(
    private_etcd: EmbeddedEtcd, private_store: MetaStore, private_settings: Settings
) -> None:
    allocator = IdAllocator(private_store, batch=5)
    before = _ids(allocator, 7)

    private_etcd.restart()
    same_client = [through_reconnect(allocator.alloc) for _ in range(7)]
    new_store = MetaStore.connect(private_settings)
    new_client = _ids(IdAllocator(new_store, batch=5), 7)
    new_store.close()

    assert min(same_client) > max(before)
    assert min(new_client) > max(same_client)


def side_by_side(run: Callable[[int], None], stores: list[MetaStore]) -> None:
    """`run(i)` for each of `stores`, each in its own thread, all started at once; then the
    stores are closed."""
    start = threading.Barrier(len(stores))

    def started(i: int) -> None:
        start.wait()
        run(i)

    threads = [threading.Thread(target=started, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()


def test_two_allocators_in_parallel_get_disjoint_ids(settings: Settings) -> None:
    stores = [MetaStore.connect(settings) for _ in range(2)]
    allocators = [IdAllocator(s, batch=3) for s in stores]
    results: list[list[int]] = [[], []]

    def run(i: int) -> None:
        results[i] = _ids(allocators[i], 60)

    side_by_side(run, stores)

    assert len(results[0]) == len(results[1]) == 60
    assert not set(results[0]) & set(results[1])
    assert all(r == sorted(r) for r in results)


def test_threads_sharing_one_allocator_get_distinct_ids(store: MetaStore) -> None:
    allocator = IdAllocator(store, batch=5)
    out: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        got = _ids(allocator, 40)
        with lock:
            out.extend(got)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(out) == len(set(out)) == 160


def test_allocator_on_a_malformed_mark_names_the_key(store: MetaStore) -> None:
    store.put(store.keys.id_allocator(), b"not-a-number")

    with pytest.raises(MalformedValueError) as bad:
        IdAllocator(store).alloc()

    assert bad.value.key == store.keys.id_allocator()


# --- TimestampOracle ----------------------------------------------------------------------


def test_timestamps_strictly_increase(store: MetaStore) -> None:
    oracle = TimestampOracle(store)

    stamps = [oracle.now() for _ in range(2000)]

    assert all(b > a for a, b in zip(stamps, stamps[1:], strict=False))


def test_timestamp_physical_part_follows_the_wall_clock(store: MetaStore) -> None:
    oracle = TimestampOracle(store)

    before = int(time.time() * 1000)
    stamp = oracle.now()
    after = int(time.time() * 1000)

    assert before <= physical_ms(stamp) <= after + 1


def test_timestamps_continue_above_the_old_ones_after_a_client_restart(settings: Settings) -> None:
    first_store = MetaStore.connect(settings)
    oracle = TimestampOracle(first_store)
    last_before = max(oracle.now() for _ in range(10))
    first_store.close()

    second_store = MetaStore.connect(settings)
    first_after = TimestampOracle(second_store).now()
    second_store.close()

    assert first_after > last_before
    assert physical_ms(first_after) <= int(time.time() * 1000), "a restarted oracle skips nothing ahead"


def test_block_of_timestamps_is_returned_as_its_last_one(store: MetaStore) -> None:
    oracle = TimestampOracle(store)
    first = oracle.now()

    last = oracle.alloc(100)

    assert last - 99 > first and oracle.now() > last


def test_two_oracles_in_parallel_never_issue_the_same_timestamp(settings: Settings) -> None:
    stores = [MetaStore.connect(settings) for _ in range(2)]
    oracles = [TimestampOracle(s) for s in stores]
    results: list[list[int]] = [[], []]

    def run(i: int) -> None:
        for _ in range(300):
            results[i].append(oracles[i].now())

    side_by_side(run, stores)

    assert not set(results[0]) & set(results[1])
    assert all(r == sorted(set(r)) for r in results)
