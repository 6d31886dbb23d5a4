"""Reads pin what they may open: garbage collection keeps the files of segments dropped
at or after a running read's timestamp, and a read that outlived its pin fails with
`ReadPinLostError`, not a missing-file error. The read runs in a real process, stopped by a
failpoint after it chose its segments and before it opened a file."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.read_pins import SharedPins, pinned, pinned_horizons
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState
from vchan_assets.query.asof import now_ts
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import Produced, produce, segments
from vchan_assets.testing.steps import sync_all
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer

from .helpers import stopped_read


@pytest.fixture
def channels() -> int:
    return 1  # `collection`'s


def two_flushed_segments(system: System, producer: Producer, info: CollectionInfo) -> Produced:
    produced = Produced()
    for batch in range(2):
        produce(producer, info.name, produced, 200, start_pk=batch * 10_000, deletes=5)
        producer.flush(info.name)
        sync_all(system, info)
    return produced


def merge(system: System, info: CollectionInfo) -> None:
    """A merge: the collection's two segments Dropped, one new segment live."""
    assert CompactionTrigger(system).trigger(info, CompactionType.MIX, manual=True)
    assert [o.state for o in CompactionExecutor(system, "local").run_pending()] == [PlanState.COMPLETED]


def collect(system: System) -> list[int]:
    """A GC pass with no tolerance left: the dropped segments it removed."""
    time.sleep(0.05)
    quick = replace(system.settings, gc_drop_tolerance=0.001, time_travel=0.001)
    return GarbageCollector(replace(system, settings=quick)).run().dropped_segments


def test_gc_keeps_what_a_running_read_may_open_and_the_read_returns_every_row(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo, tmp_path: Path
) -> None:
    produced = two_flushed_segments(system, producer, collection)
    read = stopped_read(system.settings, collection, tmp_path, VCHAN_READ_PIN_TTL="600")
    try:
        assert collection.id in pinned_horizons(store)
        merge(system, collection)
        assert collect(system) == []  # pinned: kept
    finally:
        os.kill(read.pid, signal.SIGCONT)
    out, err = read.communicate(timeout=120)
    assert read.returncode == 0, err[-3000:]
    assert f"ROWS {produced.row_count - len(produced.deleted)}" in out
    assert collection.id not in pinned_horizons(store), "the pin ended with the read"
    assert len(collect(system)) == 2, "unpinned: collected"


def test_a_read_that_outlived_its_pin_fails_naming_the_pin_not_a_missing_file(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo, tmp_path: Path
) -> None:
    two_flushed_segments(system, producer, collection)
    read = stopped_read(system.settings, collection, tmp_path, VCHAN_READ_PIN_TTL="1")
    try:
        wait_until(
            lambda: collection.id not in pinned_horizons(store),
            30,
            "the read's pin to expire with its lease (TTL 1 s)",
            interval=0.2,
            describe=lambda: pinned_horizons(store),
        )
        merge(system, collection)
        removed = collect(system)
        assert len(removed) == 2 and all(
            s.state is not SegmentState.DROPPED for s in segments(store, collection)
        )
    finally:
        os.kill(read.pid, signal.SIGCONT)
    _, err = read.communicate(timeout=120)
    assert read.returncode != 0
    assert "ReadPinLostError" in err and "outlived its pin of 1s (VCHAN_READ_PIN_TTL)" in err, err[-3000:]


def test_a_pin_holds_its_collection_back_from_its_timestamp_and_ends_with_its_read(
    store: MetaStore, storage: Storage, settings: Settings, collection: CollectionInfo
) -> None:
    ts = now_ts(store)
    with pinned(store, settings, collection.id, ts) as pin:
        assert pin.alive(store)
        [horizon] = pinned_horizons(store).values()
        assert horizon <= (ts >> 18) / 1000 and horizon <= time.time()
    assert not pin.alive(store) and pinned_horizons(store) == {}


def test_searches_share_a_young_pin_at_or_before_their_time_and_it_ends_after_its_window(
    store: MetaStore, settings: Settings, collection: CollectionInfo
) -> None:
    shared = SharedPins()  # its own, not the process's
    quick = replace(settings, read_pin_reuse=1.0)
    t1 = now_ts(store)
    with shared.pinned(store, quick, collection.id, t1) as first:
        assert first.alive(store)
    assert first.alive(store), "kept for the next search"
    with shared.pinned(store, quick, collection.id, now_ts(store)) as again:
        assert again == first
        [horizon] = pinned_horizons(store).values()
        assert horizon <= (t1 >> 18) / 1000, "GC keeps what a search at the pin's time may open"
    with shared.pinned(store, quick, collection.id, t1 - 1) as earlier:  # before the pin's time
        assert earlier != first and len(store.list_prefix(store.keys.read_pin.prefix).items) == 2
    wait_until(
        lambda: not any(p.alive(store) for p in (first, earlier)),
        30,
        "the shared pins to end after their reuse window",
    )
    assert pinned_horizons(store) == {}
    with shared.pinned(store, quick, collection.id, now_ts(store)) as fresh:
        assert fresh != first and fresh != earlier
    shared.close()
    assert not fresh.alive(store), "closed (as at the process's exit): no search holds it"


def test_a_shared_pin_lasts_while_a_search_holds_it_and_a_reuse_of_0_pins_each_search(
    store: MetaStore, settings: Settings, collection: CollectionInfo
) -> None:
    shared = SharedPins()
    with shared.pinned(store, replace(settings, read_pin_reuse=0.2), collection.id, now_ts(store)) as held:
        time.sleep(0.5)  # past its window: its timer found it held
        assert held.alive(store)
    assert not held.alive(store), "its last search ended it"
    each = replace(settings, read_pin_reuse=0.0)
    with shared.pinned(store, each, collection.id, now_ts(store)) as one:
        assert one.alive(store)
    with shared.pinned(store, each, collection.id, now_ts(store)) as two:
        assert two != one
    assert not one.alive(store) and not two.alive(store) and pinned_horizons(store) == {}
