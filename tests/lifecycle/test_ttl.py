"""Collection TTL (Milvus' `collection.ttl.seconds`): a row older than the TTL at a read's
time is never read nor searched, the change stream keeps its insert, and compaction drops
it (a segment of expired rows is rewritten alone). Real etcd, real files.

The TTL is about wall-clock time: the tests wait past it once (a few seconds), then read
at the timestamp of a later insert, so what is expired does not depend on how long the
rest of the test takes."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.lifecycle.checks import check_rows_conserved
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger, expired_ratios
from vchan_assets.lifecycle.plans import CompactionType, PlanState, list_plans
from vchan_assets.model import CollectionInfo, SegmentLevel, SegmentState, compose_ts, physical_ms
from vchan_assets.query.stream_source import VchanStreamReader
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, segments
from vchan_assets.testing.steps import flushed_segment, sync_all
from vchan_assets.testing.streams import stream_options
from vchan_assets.wal.producer import Producer, generate_rows

TTL = 5


@pytest.fixture
def aged(system: System, producer: Producer) -> tuple[CollectionInfo, int, int]:
    """100 rows (pks 0..99), then, once they are older than the TTL, 100 more (1000..1099);
    both flushed and synced. The collection and the two inserts' timestamps."""
    info = producer.create_collection(f"ttl{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=2, ttl_seconds=TTL)
    first = producer.insert(info.name, generate_rows(SCHEMA, 100, start_pk=0, seed=1))
    producer.flush(info.name)
    inserted_ms = max(physical_ms(a.timestamp) for a in first.values())
    time.sleep(max(0.0, (inserted_ms + TTL * 1000 + 500) / 1000 - time.time()))  # past the TTL
    later = producer.insert(info.name, generate_rows(SCHEMA, 100, start_pk=1000, seed=2))
    producer.flush(info.name)
    sync_all(system, info)
    first_ts = max(a.timestamp for a in first.values())
    return producer.collection(info.name), first_ts, max(a.timestamp for a in later.values())


def test_expired_rows_are_neither_read_nor_searched_but_stay_in_the_change_stream(
    system: System, aged: tuple[CollectionInfo, int, int]
) -> None:
    info, t0, t1 = aged
    catalog = Catalog(replace(system, settings=replace(system.settings, time_travel=600.0)))
    assert sorted(catalog.read_collection(info.name, as_of=t1)["pk"]) == list(range(1000, 1100))
    assert catalog.collections().query(f"name == '{info.name}'")["ttl_seconds"].tolist() == [TTL]
    # Before the first rows expired, every row is read (expiry is measured from the read's time).
    early = compose_ts(physical_ms(t1) - 10 * 1000)
    assert len(catalog.read_collection(info.name, as_of=early)) in (
        0,
        100,
    )  # no TSO time before the first insert
    hits = catalog.search(info.name, np.ones(8, dtype=np.float32), k=200, as_of=t1)
    assert sorted(hits["pk"]) == list(range(1000, 1100))

    reader = VchanStreamReader(stream_options(system.settings, system.store, info.name, fields="n"))
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    changes = pa.Table.from_batches([b for p in reader.partitions(start, end) for b in reader.read(p)])
    assert changes.filter(pa.compute.equal(changes["op"], "insert")).num_rows == 200


def test_a_segment_of_expired_rows_is_compacted_away(
    system: System, aged: tuple[CollectionInfo, int, int]
) -> None:
    info, _, _ = aged
    plans = CompactionTrigger(system).trigger(info, CompactionType.MIX)  # not manual: by the TTL
    expired = [p for p in plans if p.reason == "expired rows (TTL)"]
    assert len(expired) == 2 and all(
        p.expire_before for p in expired
    )  # the first rows' segment of each vchannel
    outcomes = CompactionExecutor(system, "local").run_pending()
    assert all(o.state is PlanState.COMPLETED for o in outcomes), outcomes
    live = [
        s
        for s in segments(system.store, info)
        if s.state is SegmentState.FLUSHED and s.level is SegmentLevel.L1
    ]
    kept = pa.concat_tables([system.storage.read_parquet(s.binlogs[0].logs[0].path) for s in live])
    assert not set(range(100)) & set(kept["pk"].to_pylist())  # the first rows are gone from the files
    cutoff = min(p.expire_before for p in expired)
    assert pa.compute.min(kept["timestamp"]).as_py() >= cutoff
    assert check_rows_conserved(
        system.store, system.storage, [d.model for d in list_plans(system.store)]
    ).passed


def test_the_expired_share_of_a_segment_is_counted_from_its_binlogs_timestamps() -> None:
    info = CollectionInfo(1, "c", SCHEMA, (2,), ("v0",), ttl_seconds=TTL)
    seg = flushed_segment(info, "v0", 7)  # 4 binlogs of 1000 rows
    newest = [b.ts_to for b in seg.binlogs[0].logs]
    assert expired_ratios([seg], 0) == {}
    assert expired_ratios([seg], newest[1] + 1) == {7: 0.5}
    assert expired_ratios([seg], newest[3] + 1) == {7: 1.0}
