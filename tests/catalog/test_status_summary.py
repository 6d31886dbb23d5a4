"""`vchan status` at scale: the default report counts segments from the summaries the
DataCoord writes at its meta reload (`meta/summary/{collection}`) and reads no segment key;
`--segments` reads segment meta itself, narrowed to a collection or a vchannel."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.datacoord.segment_summary import collection_ids, summarize
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState, SegmentSummary
from vchan_assets.status import SUMMARY_STALE_AFTER, SegmentDetail, collect_status
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, Produced, cli_env, produce
from vchan_assets.testing.steps import compact_all, new_collection, reads, sync_all, write_segments
from vchan_assets.wal.producer import Producer


@pytest.fixture
def coordinator(settings: Settings, store: MetaStore) -> Iterator[DataCoordinator]:
    """The active DataCoord, activated (its first reload done); the test reloads it."""
    coord = DataCoordinator(settings, store, reload_interval=0.0)
    assert coord.election.campaign(timeout=5.0)
    coord.activate()
    try:
        yield coord
    finally:
        coord.election.resign()


def reload(coordinator: DataCoordinator) -> bool:
    assert coordinator.reloader is not None
    return coordinator.reloader.reload()


def summaries_in_etcd(store: MetaStore) -> dict[int, SegmentSummary]:
    found, _ = store.list_models(store.keys.segment_summary.prefix, SegmentSummary)
    return {d.model.collection_id: d.model for d in found}


def whole_table_rows(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The report's segment rows computed from every segment (`Catalog.segments`), as
    `vchan status` computed them before the summaries."""
    counts: dict[tuple[str, str, str], Counter[str]] = defaultdict(Counter)
    for seg in table.itertuples():
        counts[(str(seg.collection), str(seg.state), str(seg.level))].update(
            segments=1,
            rows=int(seg.num_rows),
            binlog_bytes=int(seg.size_bytes),
            sorted=int(bool(seg.is_sorted)),
            invisible=int(bool(seg.invisible) and seg.state != "Dropped"),
            compacted=int(len(seg.compaction_from) > 0),
        )
    keys = ("segments", "rows", "binlog_bytes", "sorted", "invisible", "compacted")
    return [
        {"collection": c, "state": s, "level": lvl, **{k: n[k] for k in keys}}
        for (c, s, lvl), n in sorted(counts.items())
    ]


def assert_the_summary_is_the_whole_table(system: System, coordinator: DataCoordinator) -> None:
    reload(coordinator)
    store = system.store
    every = SegmentMeta(store).list(include_dropped=True)
    counted = summarize([d.model for d in every], collection_ids(store), 0, 0.0)
    held = summaries_in_etcd(store)
    assert held.keys() == counted.keys()
    assert all(held[c].same_counts(counted[c]) for c in counted)
    now = time.time()
    with Catalog(system) as catalog:
        default = collect_status(catalog, now=now)
        listed = collect_status(catalog, now=now, segments=SegmentDetail())
        assert default["segments"] == whole_table_rows(catalog.segments()) == listed["segments"]
    assert default["handoff"] == listed["handoff"]
    assert default["segments_source"] == "summary" and listed["segments_source"] == "segment meta"


def test_the_summary_a_reload_writes_is_what_the_whole_table_counts_after_syncs_a_seal_a_sort_and_a_compaction(
    system: System, producer: Producer, collection: CollectionInfo, coordinator: DataCoordinator
) -> None:
    assert_the_summary_is_the_whole_table(system, coordinator)  # no segment yet: an empty summary
    produce(producer, collection.name, Produced(), 300, start_pk=0, deletes=10)
    assert_the_summary_is_the_whole_table(system, coordinator)  # Growing
    producer.flush(collection.name)
    assert_the_summary_is_the_whole_table(system, coordinator)  # sealed
    sync_all(system, collection)
    assert_the_summary_is_the_whole_table(system, coordinator)  # Flushed, invisible; L0
    produce(producer, collection.name, Produced(), 300, start_pk=10_000, deletes=10)
    producer.flush(collection.name)
    sync_all(system, collection)
    sort_step(system, engine="local")
    assert_the_summary_is_the_whole_table(system, coordinator)  # sorted; parents Dropped
    with Catalog(system) as catalog:
        assert collect_status(catalog)["handoff"]["sorted"] >= 2
    compact_all(system, collection)
    assert_the_summary_is_the_whole_table(system, coordinator)  # inputs Dropped, one compacted


def test_a_reload_writes_a_summary_only_when_it_changed(
    store: MetaStore, producer: Producer, collection: CollectionInfo, coordinator: DataCoordinator
) -> None:
    key = store.keys.segment_summary(collection.id)
    first = store.get(key)
    assert first is not None, "the first reload of a term writes every collection's summary"
    assert not reload(coordinator) and not reload(coordinator)
    assert store.get(key) == first, "an idle stack's reload wrote its summary again"
    write_segments(store, collection, collection.vchannels[0], 3)
    assert reload(coordinator)
    changed = store.get(key)
    assert changed is not None and changed.version == first.version + 1
    other = new_collection(producer)  # no segment: the reload still gives it its summary
    assert reload(coordinator)
    assert summaries_in_etcd(store)[other.id].groups == ()
    assert store.get(key) == changed


def test_a_drop_and_gc_deleting_the_dropped_record_are_changes_the_reload_counts(
    store: MetaStore, collection: CollectionInfo, coordinator: DataCoordinator
) -> None:
    write_segments(store, collection, collection.vchannels[0], 2)
    reload(coordinator)
    door = SegmentMeta(store)
    first = door.list(collection.id)[0]
    moved = door.swap(first.kv.version, first.model.with_changes(state=SegmentState.DROPPED, dropped_at=1.0))

    assert reload(coordinator)
    states = {g.state: g.segments for g in summaries_in_etcd(store)[collection.id].groups}
    assert states == {SegmentState.FLUSHED: 1, SegmentState.DROPPED: 1}
    door.delete(moved)  # GC, after the tolerance: only the dropped family changed
    assert reload(coordinator)
    states = {g.state: g.segments for g in summaries_in_etcd(store)[collection.id].groups}
    assert states == {SegmentState.FLUSHED: 1}


def test_the_default_status_reads_no_segment_key(
    system: System, collection: CollectionInfo, coordinator: DataCoordinator
) -> None:
    meta_bytes = write_segments(system.store, collection, collection.vchannels[0], 200)
    reload(coordinator)
    with Catalog(system) as catalog:
        _, summary_bytes = reads(catalog.store, lambda: collect_status(catalog))
        _, listed_bytes = reads(catalog.store, lambda: collect_status(catalog, segments=SegmentDetail()))
        [row] = collect_status(catalog)["segments"]
    assert row["segments"] == 200 and row["rows"] == 200 * 4000
    assert listed_bytes > meta_bytes
    assert summary_bytes < meta_bytes / 20, f"the default status read {summary_bytes} bytes of etcd"


def test_segments_narrowed_to_a_vchannel_read_only_that_vchannels_segments(
    system: System, collection: CollectionInfo
) -> None:
    mine, crowded = collection.vchannels
    write_segments(system.store, collection, mine, 5, first=1_000)
    crowd_bytes = write_segments(system.store, collection, crowded, 200, first=2_000)
    with Catalog(system) as catalog:
        narrowed = SegmentDetail(vchannel=mine)
        _, size = reads(catalog.store, lambda: collect_status(catalog, segments=narrowed))
        report = collect_status(catalog, segments=narrowed)
        whole = collect_status(catalog, segments=SegmentDetail(collection=collection.name))
    assert size < crowd_bytes / 20, f"--segments --vchannel read {size} bytes of etcd"
    assert [r["segment_id"] for r in report["segment_detail"]] == list(range(1_000, 1_005))
    assert {r["vchannel"] for r in report["segment_detail"]} == {mine}
    assert [r["segments"] for r in report["segments"]] == [5]
    assert len(whole["segment_detail"]) == 205


def test_a_collection_without_a_summary_is_warned_of_with_the_command_that_reads_its_segments(
    system: System, collection: CollectionInfo
) -> None:
    with Catalog(system) as catalog:
        report = collect_status(catalog)
    [warning] = [w for w in report["warnings"] if w["kind"] == "no_segment_summary"]
    assert f"vchan status --segments --collection {collection.name}" in warning["message"]


def test_old_summaries_are_stale_only_while_no_datacoord_is_active(
    system: System, collection: CollectionInfo, coordinator: DataCoordinator
) -> None:
    later = time.time() + SUMMARY_STALE_AFTER + 60
    with Catalog(system) as catalog:
        kept = collect_status(catalog, now=later)
        coordinator.election.resign()
        unkept = collect_status(catalog, now=later)
    assert not [w for w in kept["warnings"] if "summary" in w["kind"]]
    [warning] = [w for w in unkept["warnings"] if w["kind"] == "stale_segment_summary"]
    assert "no DataCoord is active" in warning["message"] and "vchan status --segments" in warning["message"]


def test_a_malformed_summary_is_a_warning_naming_its_key_and_the_next_reload_writes_over_it(
    system: System, collection: CollectionInfo, coordinator: DataCoordinator
) -> None:
    store = system.store
    key = store.keys.segment_summary(collection.id)
    store.put(key, b"{not json")
    with Catalog(system) as catalog:
        report = collect_status(catalog)
    [warning] = [w for w in report["warnings"] if w["kind"] == "malformed_summary"]
    assert key in warning["message"] and "vchan status --segments" in warning["message"]
    assert not [w for w in report["warnings"] if w["kind"] == "no_segment_summary"]
    write_segments(store, collection, collection.vchannels[0], 2)
    writer = coordinator.writer  # the store fenced by its term (it counts on its own)
    assert writer is not None
    skipped = writer.malformed_skipped
    assert reload(coordinator)
    assert writer.malformed_skipped == skipped + 1, "the malformed summary was not logged and counted"
    assert sum(g.segments for g in summaries_in_etcd(store)[collection.id].groups) == 2


def test_vchan_status_segments_narrows_to_a_vchannel_and_the_filters_need_segments(
    settings: Settings, store: MetaStore, collection: CollectionInfo
) -> None:
    mine, other = collection.vchannels
    write_segments(store, collection, mine, 2, first=1_000)
    write_segments(store, collection, other, 3, first=2_000)

    def status(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VCHAN), "status", "--json", *flags],
            env=cli_env(settings),
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = status("--segments", "--vchannel", mine)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert [r["segment_id"] for r in report["segment_detail"]] == [1_000, 1_001]
    refused = status("--collection", collection.name)
    assert refused.returncode == 1 and "--segments" in refused.stderr
