"""The checks of a vchannel's query view (what the Dagster `visible_segments` asset reports):
a read at T through the view serves each live row of the log once, wherever it lives (log
tail, growing, invisible or sorted segment), and fails naming the count when a segment meta
is written twice or a served segment is dropped without its copy; the invisible segments
stay within the limit until the sort falls behind. Real etcd and files, the local engine."""

from __future__ import annotations

import time
import uuid

import pytest

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datanode.checks import CheckOutcome
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentLevel
from vchan_assets.query.checks import (
    check_invisible_segments,
    check_rows_served_once,
    check_time,
    view_figures,
)
from vchan_assets.query.view import QueryView, read_query_view
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced, produce, segments
from vchan_assets.testing.steps import (
    compact_all,
    drop_without_copy,
    expected_pks,
    flushed_batches,
    live_l1,
    retain,
    sync_all,
    write_twice,
)
from vchan_assets.wal.producer import Producer
from vchan_assets.wal.reader import WalReader


@pytest.fixture
def channels() -> int:
    return 1  # `collection`'s


def flushed(
    system: System,
    producer: Producer,
    info: CollectionInfo,
    produced: Produced,
    start_pk: int,
) -> None:
    """A round of 200 rows and 10 deletes, flushed and synced: one invisible segment."""
    produce(producer, info.name, produced, 200, start_pk=start_pk, deletes=10)
    producer.flush(info.name)
    sync_all(system, info)


def rows_check(system: System, info: CollectionInfo, vchannel: str | None = None) -> CheckOutcome:
    """The rows check of a vchannel (the first one by default) at its `check_time`."""
    vchannel = vchannel or info.vchannels[0]
    return check_rows_served_once(system, info, vchannel, check_time(system.store, system.settings, vchannel))


def served_once(system: System, info: CollectionInfo, vchannel: str) -> dict[str, int | float | str]:
    outcome = rows_check(system, info, vchannel)
    assert outcome.passed, outcome.description
    return outcome.metadata


def fails(outcome: CheckOutcome, says: str, **counts: int) -> None:
    """The check failed, with these counts in its metadata and `says` in its description."""
    assert not outcome.passed and says in outcome.description, outcome.description
    assert {k: outcome.metadata[k] for k in counts} == counts


def view(store: MetaStore, info: CollectionInfo, vchannel: str) -> QueryView:
    return read_query_view(store, CollectionRegistry(store).get(info.id), vchannel)


def test_a_read_through_the_view_serves_each_live_row_once_in_sorted_invisible_growing_segments_and_the_tail(
    system: System, store: MetaStore, producer: Producer
) -> None:
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=2)
    produced = Produced()
    flushed(system, producer, info, produced, 0)
    sort_step(system, engine="local")  # sorted, visible
    flushed(system, producer, info, produced, 10_000)  # invisible
    produce(producer, info.name, produced, 200, start_pk=20_000, deletes=5)
    sync_all(system, info)  # growing, with binlogs
    produce(producer, info.name, produced, 100, start_pk=30_000, deletes=5)  # only in the log

    served = 0
    for vchannel in info.vchannels:
        figures = view_figures(view(store, info, vchannel), time.time())
        assert (figures["flushed"], figures["invisible"], figures["growing"]) == (1, 1, 1)
        assert figures["flush_to_sorted_s_max"] >= 0 and figures["sorts_in_meta"] == 1
        found = served_once(system, info, vchannel)
        assert found["rows_served"] == found["log_rows"]
        assert found["rows_served_twice"] == found["rows_missing"] == found["rows_not_in_log"] == 0
        served += int(found["rows_served"])
    assert served == len(expected_pks(produced))


def test_the_rows_check_fails_naming_the_count_when_a_segment_meta_is_written_twice(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    flushed(system, producer, collection, Produced(), 0)
    sort_step(system, engine="local")
    served_once(system, collection, collection.vchannels[0])
    [seg] = live_l1(store, collection)
    write_twice(store, seg)

    fails(
        rows_check(system, collection),
        "190 served twice (190 pks)",
        rows_served_twice=190,
        pks_served_twice=190,
    )


def test_the_rows_check_fails_naming_the_count_when_a_served_segment_is_dropped_without_its_copy(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    flushed(system, producer, collection, Produced(), 0)
    sort_step(system, engine="local")
    flushed(system, producer, collection, Produced(), 10_000)
    [sorted_one, invisible] = sorted(live_l1(store, collection), key=lambda s: s.is_invisible)
    assert sorted_one.is_sorted and invisible.is_invisible
    drop_without_copy(store, invisible)

    fails(rows_check(system, collection), "190 missing", rows_missing=190, rows_served_twice=0)


def test_the_rows_check_fails_when_a_delete_is_lost_and_the_rows_it_deleted_are_served(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    flushed(system, producer, collection, Produced(), 0)
    [l0] = [s for s in segments(store, collection) if s.level is SegmentLevel.L0]
    drop_without_copy(store, l0)

    fails(rows_check(system, collection), "10 not live in the log", rows_not_in_log=10, rows_missing=0)


def test_the_invisible_check_passes_up_to_the_limit_and_fails_past_it_until_the_sort_catches_up(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    for start in (0, 10_000, 20_000):  # three flushes, no sort: three invisible segments
        flushed(system, producer, collection, Produced(), start)
    behind = view(store, collection, collection.vchannels[0])
    assert check_invisible_segments(behind, 3, time.time()).passed
    failing = check_invisible_segments(behind, 2, time.time())
    assert not failing.passed and failing.metadata["invisible"] == 3 and failing.metadata["limit"] == 2
    assert failing.metadata["oldest_invisible_s"] > 0
    assert "3 flushed segments wait for their sort" in failing.description

    sort_step(system, engine="local")
    caught_up = view(store, collection, collection.vchannels[0])
    assert check_invisible_segments(caught_up, 2, time.time()).passed
    assert view_figures(caught_up, time.time())["invisible"] == 0


def test_after_log_retention_the_rows_check_compares_from_the_first_retained_offset(
    system: System, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    flushed_batches(system, producer, collection, batches=3)
    compact_all(system, collection)  # one segment with rows below and above the floor
    retain(system)
    produce(producer, collection.name, Produced(), 50, start_pk=90_000)  # and a log tail
    [vchannel] = collection.vchannels
    floor = WalReader(storage, vchannel, collection).files()[0].first_offset

    found = served_once(system, collection, vchannel)
    assert found["retained_from_offset"] == floor > 0
    assert int(found["rows_not_compared"]) > 0 and int(found["log_rows"]) >= 50
    assert found["rows_served"] == int(found["log_rows"]) + int(found["rows_not_compared"])
