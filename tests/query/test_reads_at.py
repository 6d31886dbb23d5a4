"""Reads at a timestamp: every row inserted at or before T and not deleted at or before
T, once, wherever it lives when the read runs (the log after the checkpoint, a growing, an
invisible or a sorted segment, a compaction's output); T defaults to now."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState, compose_ts, physical_ms
from vchan_assets.query import asof
from vchan_assets.query.asof import (
    READ_ATTEMPTS,
    LogMovedError,
    TimeTravelError,
    iso,
    now_ts,
    replanned,
    tail_of,
    views_at,
)
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, VCHAN, Produced, cli_env, produce, segments
from vchan_assets.testing.steps import expected_pks, sync_all
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import read_pks, stopped_read


@pytest.fixture
def travel(system: System) -> System:
    """The test's system, its reads may go ten minutes back."""
    return replace(system, settings=replace(system.settings, time_travel=600.0))


def pks(catalog: Catalog, info: CollectionInfo, as_of: object = None) -> list[int]:
    rows = catalog.read_collection(info.name, as_arrow=True, with_vectors=False, as_of=as_of)
    assert isinstance(rows, pa.Table)
    found = rows["pk"].to_pylist()
    assert len(found) == len(set(found)), "a pk read twice"
    return sorted(found)


def test_a_read_right_after_produce_returns_what_was_written_before_any_sync(
    system: System, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 300, start_pk=0, deletes=20)
    catalog = Catalog(system)
    assert pks(catalog, collection) == expected_pks(produced)
    rows = catalog.read_collection(collection.name)
    assert set(rows["segment_id"]) and rows["vec"].map(len).eq(SCHEMA.fields[1].dim * 4).all()
    # the same rows, column for column, once they are in binlogs
    producer.flush(collection.name)
    sync_all(system, collection)
    after = catalog.read_collection(collection.name).sort_values("pk").reset_index(drop=True)
    before = rows.sort_values("pk").reset_index(drop=True)
    assert list(after.columns) == list(before.columns)
    assert after.drop(columns=["segment_id"]).equals(before.drop(columns=["segment_id"]))


def test_every_row_is_read_once_in_log_growing_invisible_and_sorted_segments(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    catalog = Catalog(system)
    produce(producer, collection.name, produced, 200, start_pk=0, deletes=10)
    producer.flush(collection.name)
    sync_all(system, collection)  # flushed, invisible
    produce(producer, collection.name, produced, 200, start_pk=10_000, deletes=5)
    producer.flush(collection.name)
    sync_all(system, collection)
    sort_step(system, engine="local")  # sorted, visible
    produce(producer, collection.name, produced, 200, start_pk=20_000)
    sync_all(system, collection)  # growing, with binlogs
    produce(producer, collection.name, produced, 200, start_pk=30_000, deletes=7)  # only in the log
    states = {(s.state, s.is_invisible, s.is_sorted) for s in segments(store, collection)}
    assert (SegmentState.GROWING, False, False) in states and (SegmentState.FLUSHED, False, True) in states
    assert pks(catalog, collection) == expected_pks(produced)


def test_a_sync_killed_between_segment_meta_and_checkpoint_reads_each_row_once(
    system: System, settings: Settings, producer: Producer, collection: CollectionInfo, tmp_path: Path
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 500, start_pk=0, deletes=25)
    env = cli_env(
        settings, VCHAN_FAILPOINT="before_checkpoint=kill", VCHAN_FAILPOINT_MARKER=str(tmp_path / "fp")
    )
    done = subprocess.run(
        [str(VCHAN), "sync", "--collection", collection.name, "--take-lease", "--engine", "local"],
        env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode < 0, "killed at the failpoint"
    assert any(s.binlogs for s in segments(system.store, collection)), "segment meta committed"
    # Rows now both in binlogs and in the log after the (old) checkpoint: read once.
    assert pks(Catalog(system), collection) == expected_pks(produced)


def test_a_sync_committing_after_a_read_took_its_timestamp_before_it_reads_meta_loses_no_row(
    system: System, settings: Settings, producer: Producer, collection: CollectionInfo, tmp_path: Path
) -> None:
    """The read's checkpoints and segments are one snapshot taken after the sync: the rows
    it moved into segments are read from there, once."""
    produced = Produced()
    produce(producer, collection.name, produced, 300, start_pk=0, deletes=20)  # only in the log
    reader = stopped_read(settings, collection, tmp_path, "read_meta")
    try:
        # Segment meta, then the checkpoint past every row: all of it after the read's
        # timestamp, before it reads its checkpoints and segments.
        sync_all(system, collection)
        assert any(s.binlogs for s in segments(system.store, collection))
    finally:
        reader.send_signal(signal.SIGCONT)
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-2000:]
    assert read_pks(out) == expected_pks(produced)


@pytest.mark.parametrize("stopped_at", ["read_planned", "read_tail_listed"])
def test_a_read_whose_log_tail_retention_removed_meanwhile_plans_again_and_loses_nothing(
    system: System,
    settings: Settings,
    producer: Producer,
    collection: CollectionInfo,
    tmp_path: Path,
    stopped_at: str,
) -> None:
    """A read plans its log tail from the checkpoint it read; a sync then moves the
    checkpoint past the tail's first files (their rows into segments the read did not list)
    and log retention removes those files before the read opens them: the read stopped
    after choosing its segments (`read_planned`), or after listing the tail's files
    (`read_tail_listed`: the first one still followed its checkpoint then). Reading on from
    the files left would silently lose those rows and deletes, and a listed file is gone:
    the read plans again instead (a fresh-clone CI run met the second case under load, a
    read failing with CorruptLogError "its data file is missing")."""
    produced = Produced()
    produce(producer, collection.name, produced, 200, start_pk=0, deletes=5)
    sync_all(system, collection)
    produce(producer, collection.name, produced, 200, start_pk=10_000, deletes=5)  # only in the log
    reader = stopped_read(settings, collection, tmp_path, stopped_at, "stop-once")
    try:
        sync_all(system, collection)  # the second batch now in segments too
        later = Produced()  # after the read began (its "now" may still cover it)
        produce(producer, collection.name, later, 200, start_pk=20_000)
        time.sleep(0.05)
        quick = replace(settings, wal_retention=0.001)
        removed = GarbageCollector(replace(system, settings=quick)).run().wal_files
        assert removed, "log retention removed the files the read planned to open"
    finally:
        reader.send_signal(signal.SIGCONT)
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-2000:]
    with_later = Produced(produced.rows + later.rows, produced.deleted)
    assert read_pks(out) in (expected_pks(produced), expected_pks(with_later))


def test_a_log_tail_whose_files_retention_removed_says_so_instead_of_reading_on(
    system: System, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    """What a Spark task reading a tail planned on the driver gets when retention removed
    its files meanwhile (it cannot plan again): the error, naming the vchannel."""
    produce(producer, collection.name, Produced(), 100, start_pk=0, deletes=5)
    ts = now_ts(system.store)
    segs, views = views_at(system.store, collection, ts)
    tail = tail_of(views[0], segs, ts)
    sync_all(system, collection)
    produce(producer, collection.name, Produced(), 100, start_pk=1_000)
    time.sleep(0.05)
    assert GarbageCollector(replace(system, settings=replace(settings, wal_retention=0.001))).run().wal_files
    with pytest.raises(
        LogMovedError, match=f"the log of {tail.vchannel} after offset {tail.after_offset} was removed"
    ):
        tail.read(storage, collection)
    calls = []

    def lost() -> None:
        calls.append(1)
        tail.plan(storage, collection)

    with pytest.raises(LogMovedError):
        replanned(lost)
    assert len(calls) == READ_ATTEMPTS  # planned again, then given up


def kept_footers(system: System, collection: CollectionInfo) -> set[str]:
    """The log files whose footers the kept tail readers of the collection hold."""
    kept = asof._TAIL_READERS.found
    return {
        key
        for v in collection.vchannels
        if (system.storage, v, collection.id) in kept
        for key in kept[(system.storage, v, collection.id)][0]._footers
    }


def test_reads_at_now_keep_their_log_readers_and_still_see_every_new_message(
    system: System, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    """A read's log tail comes from a reader kept between reads (the footers of the files
    it described are not read again): new files, a sync and log retention in between
    change nothing a read returns, and the kept reader forgets the files its checkpoint
    passed."""
    produced = Produced()
    catalog = Catalog(system)
    produce(producer, collection.name, produced, 100, start_pk=0, deletes=5)  # only in the log
    assert pks(catalog, collection) == expected_pks(produced)
    described = kept_footers(system, collection)
    assert described, "the read kept its tail's readers, with the footers they read"
    produce(producer, collection.name, produced, 100, start_pk=1_000, deletes=5)
    assert pks(catalog, collection) == expected_pks(produced)
    assert described <= kept_footers(system, collection), "the first read's footers kept, not read again"
    sync_all(system, collection)
    time.sleep(0.05)
    quick = replace(settings, wal_retention=0.001)
    assert GarbageCollector(replace(system, settings=quick)).run().wal_files
    produce(producer, collection.name, produced, 100, start_pk=2_000, deletes=5)
    assert pks(catalog, collection) == expected_pks(produced)
    assert not described & kept_footers(system, collection), "the files before the checkpoint forgotten"


def test_a_read_at_t_sees_neither_later_inserts_nor_later_deletes(
    travel: System, producer: Producer, collection: CollectionInfo
) -> None:
    first = Produced()
    rows = generate_rows(SCHEMA, 300, start_pk=0, seed=0)
    appended = [*producer.insert(collection.name, rows).values()]
    appended += producer.delete(collection.name, list(range(10)), partition="_default").values()
    first.rows.append(rows)
    first.deleted.extend(range(10))
    t1 = max(a.timestamp for a in appended)  # what this producer had written, acknowledged
    later = Produced()
    produce(producer, collection.name, later, 300, start_pk=10_000)
    producer.delete(collection.name, list(range(10, 40)), partition="_default")
    producer.flush(collection.name)
    sync_all(travel, collection)
    catalog = Catalog(travel)
    assert pks(catalog, collection, as_of=t1) == expected_pks(first)
    # A wall-clock time reads what was stamped before it: to the end of the millisecond before
    assert pks(catalog, collection, as_of=iso(t1)) == pks(catalog, collection, as_of=t1 - (t1 & 0x3FFFF) - 1)
    everything = set(expected_pks(first)) | set(expected_pks(later))
    assert pks(catalog, collection) == sorted(everything - set(range(10, 40)))


def test_a_read_at_t_before_a_compaction_still_sees_the_rows_it_removed(
    store: MetaStore, storage: Storage, travel: System, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    t1 = 0
    for batch in range(2):
        rows = generate_rows(SCHEMA, 200, start_pk=batch * 10_000, seed=batch)
        t1 = max(a.timestamp for a in producer.insert(collection.name, rows).values())
        produced.rows.append(rows)
        producer.flush(collection.name)
        sync_all(travel, collection)
    producer.delete(collection.name, list(range(0, 50)), partition="_default")
    producer.flush(collection.name)
    sync_all(travel, collection)
    system = travel
    for kind in (CompactionType.L0, CompactionType.MIX):  # deletes into the segments, then merged away
        assert CompactionTrigger(system).trigger(collection, kind, manual=True)
        outcomes = CompactionExecutor(system, "local").run_pending()
        assert outcomes and all(o.state is PlanState.COMPLETED for o in outcomes)
    live_rows = sum(s.num_rows for s in segments(store, collection) if s.state is not SegmentState.DROPPED)
    assert live_rows == 400 - 50, "the deleted rows were removed physically"
    catalog = Catalog(system)
    assert pks(catalog, collection, as_of=t1) == expected_pks(produced)
    assert pks(catalog, collection) == [pk for pk in expected_pks(produced) if pk >= 50]
    # GC keeps what a read in the window needs, even past its drop tolerance
    GarbageCollector(replace(system, settings=replace(travel.settings, gc_drop_tolerance=0.0))).run()
    dropped = [s for s in segments(store, collection) if s.state is SegmentState.DROPPED and s.binlogs]
    assert dropped and all(storage.exists(p) for s in dropped for p in s.file_paths)
    assert pks(catalog, collection, as_of=t1) == expected_pks(produced)


def test_a_read_at_t_before_a_compaction_sees_the_rows_it_removed_with_timestamps_ahead_of_the_clock(
    store: MetaStore, storage: Storage, travel: System, collection: CollectionInfo
) -> None:
    # An earlier version's oracles persisted their window 3 s ahead of the wall clock: the
    # timestamps follow that mark until the clock passes it.
    store.put(store.keys.tso(), str(int(time.time() * 1000) + 3000).encode())
    system = travel
    producer = Producer(system)
    produced = Produced()
    rows = generate_rows(SCHEMA, 200, start_pk=0, seed=0)
    t1 = max(a.timestamp for a in producer.insert(collection.name, rows).values())
    produced.rows.append(rows)
    assert physical_ms(t1) > (time.time() + 1) * 1000, "timestamps ahead of the wall clock"
    producer.flush(collection.name)
    sync_all(travel, collection)
    producer.delete(collection.name, list(range(50)), partition="_default")  # after t1
    producer.flush(collection.name)
    sync_all(travel, collection)
    for kind in (CompactionType.L0, CompactionType.MIX):  # within a second of the deletes, by the clock
        assert CompactionTrigger(system).trigger(collection, kind, manual=True)
        assert all(o.state is PlanState.COMPLETED for o in CompactionExecutor(system, "local").run_pending())
    catalog = Catalog(system)
    assert pks(catalog, collection, as_of=t1) == expected_pks(produced)
    assert pks(catalog, collection) == list(range(50, 200))


def test_a_read_at_a_wall_clock_time_has_every_row_acknowledged_before_it_and_none_inserted_after(
    settings: Settings, travel: System, collection: CollectionInfo
) -> None:
    stores = [MetaStore.connect(settings) for _ in range(2)]
    producers = [Producer(replace(travel, store=s)) for s in stores]  # two clients, two oracles
    inserts: list[tuple[float, float, range]] = []  # (started, acknowledged, pks)

    def insert(i: int) -> None:
        for batch in range(12):
            first = (i * 100 + batch) * 10
            rows = generate_rows(SCHEMA, 10, start_pk=first, seed=first)
            started = time.time()
            producers[i].insert(collection.name, rows)
            inserts.append((started, time.time(), range(first, first + 10)))

    threads = [threading.Thread(target=insert, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, s in zip(producers, stores, strict=True):
        p.close()
        s.close()

    catalog = Catalog(travel)
    acks = sorted(acked for _, acked, _ in inserts)
    for instant in acks[2::5]:
        read = set(pks(catalog, collection, as_of=dt.datetime.fromtimestamp(instant, dt.UTC)))
        acked_before = {pk for _, acked, r in inserts if acked <= instant for pk in r}
        started_after = {pk for started, _, r in inserts if started >= instant + 0.001 for pk in r}
        assert acked_before <= read, f"as of {instant}: rows acknowledged before it are missing"
        assert not started_after & read, f"as of {instant}: rows inserted after it are read"


def test_bad_as_of_values_are_refused_naming_the_reason(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    catalog = Catalog(System(replace(settings, time_travel=60.0), store, storage))
    now = now_ts(store)
    future = compose_ts((now >> 18) + 60_000)
    with pytest.raises(TimeTravelError, match="is in the future"):
        catalog.read_collection(collection.name, as_of=future)
    old = compose_ts((now >> 18) - 120_000)
    with pytest.raises(
        TimeTravelError,
        match=r"older than the time-travel window \(VCHAN_TIME_TRAVEL=60s\): the oldest readable time is 20",
    ):
        catalog.read_collection(collection.name, as_of=old)
    for bad in ("yesterday", 3.5, True):
        with pytest.raises(TimeTravelError, match="not a timestamp"):
            catalog.read_collection(collection.name, as_of=bad)
    with pytest.raises(TimeTravelError, match="not a hybrid timestamp"):
        catalog.read_collection(collection.name, as_of=12345)


def test_the_time_travel_window_is_measured_on_the_wall_clock_not_on_the_oracles_mark(
    store: MetaStore, storage: Storage, settings: Settings, collection: CollectionInfo
) -> None:
    store.put(store.keys.tso(), str(int(time.time() * 1000) + 3000).encode())  # a mark ahead
    assert physical_ms(now_ts(store)) > time.time() * 1000 + 2000, "'now' is ahead of the wall clock"
    catalog = Catalog(System(replace(settings, time_travel=5.0), store, storage))
    four_seconds_ago = compose_ts(int((time.time() - 4) * 1000))
    assert pks(catalog, collection, as_of=four_seconds_ago) == []  # inside the window: read
