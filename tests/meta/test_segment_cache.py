"""The DataCoord's segment meta in memory (`SegmentCache`): a listing through the door of a
process that holds it returns what a listing of etcd returns, changes made by another
client included the moment they commit, without reading a segment value from etcd; a
stream that fell behind etcd's compaction loads again in pages and says so; with etcd
gone, a listing fails as it does without the cache instead of answering from a stale copy."""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.lifecycle.step import lifecycle_step
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.errors import MalformedValueError, MetaUnavailableError
from vchan_assets.meta.segment_cache import SegmentCache
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentState, SegmentSummary
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.steps import (
    SCHEMA,
    assert_channel_index_complete,
    flushed_segment,
    new_collection,
    write_segments,
)
from vchan_assets.testing.tcp_proxy import Endpoint
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer


def listing(found: list[Decoded[SegmentInfo]]) -> list[tuple[str, int, int, SegmentInfo]]:
    return [(d.kv.key, d.kv.version, d.kv.mod_revision, d.model) for d in found]


def test_a_cached_listing_is_what_etcd_lists_after_every_change_another_client_commits(
    store: MetaStore, cached: MetaStore, producer: Producer
) -> None:
    info = new_collection(producer)
    other = new_collection(producer)
    one, two = info.vchannels
    write_segments(store, info, one, 30, first=1_000)
    write_segments(store, info, two, 20, first=2_000)
    write_segments(store, other, other.vchannels[0], 10, first=3_000)
    door, etcd = SegmentMeta(cached), SegmentMeta(store)

    def same() -> None:
        for collection, vchannel, states in [
            (None, None, None),
            (info.id, None, None),
            (info.id, two, None),
            (other.id, None, None),
            (info.id, None, [SegmentState.DROPPED]),
        ]:
            got = door.list(collection, vchannel=vchannel, states=states)  # first: right after the write
            assert listing(got) == listing(etcd.list(collection, vchannel=vchannel, states=states))
        assert listing(door.list(info.id, partition=info.partitions[0])) == listing(
            etcd.list(info.id, partition=info.partitions[0])
        )
        for collection, vchannel in [(None, None), (info.id, None), (info.id, two)]:  # the dropped family too
            got = door.list(collection, vchannel=vchannel, include_dropped=True)
            assert listing(got) == listing(etcd.list(collection, vchannel=vchannel, include_dropped=True))

    same()
    for i, found in enumerate(etcd.list(info.id)[:25]):
        # Each change by the other client is seen by the very next listing, no wait between.
        if i % 3 == 0:
            etcd.delete(found)
        else:
            etcd.swap(found.kv.version, found.model.with_changes(state=SegmentState.DROPPED, dropped_at=1.0))
        same()
    etcd.create(flushed_segment(info, one, 9_999))
    same()
    # a Dropped record in the live family, as a version before the dropped family left it
    legacy = flushed_segment(info, one, 9_998).with_changes(state=SegmentState.DROPPED, dropped_at=1.0)
    store.put(store.keys.segment(info.id, legacy.partition_id, legacy.id), legacy)
    same()
    assert 9_998 in {d.model.id for d in door.list(info.id, include_dropped=True)}

    reads = cached.keys_read
    for _ in range(5):
        door.list()
        door.list(info.id, vchannel=one)
        door.list(info.id, include_dropped=True)
    assert cached.keys_read == reads, "a cached listing read segment keys from etcd"
    assert cached.segment_cache is not None and cached.segment_cache.progress_timeouts == 0


def test_a_malformed_value_raises_naming_its_key_or_is_skipped_as_without_the_cache(
    store: MetaStore, cached: MetaStore, producer: Producer
) -> None:
    info = new_collection(producer)
    write_segments(store, info, info.vchannels[0], 3, first=1_000)
    bad = store.keys.segment(info.id, info.partitions[0], 1_001)
    store.put(bad, b"{not json")

    with pytest.raises(MalformedValueError, match=bad):
        SegmentMeta(cached).list(info.id)
    skipped = cached.malformed_skipped
    assert [d.model.id for d in SegmentMeta(cached).list(info.id, skip_malformed=True)] == [1_000, 1_002]
    assert cached.malformed_skipped == skipped + 1
    # Written again, well formed: listed again, nothing skipped or raised.
    store.put(bad, flushed_segment(info, info.vchannels[0], 1_001))
    assert [d.model.id for d in SegmentMeta(cached).list(info.id)] == [1_000, 1_001, 1_002]
    assert cached.malformed_skipped == skipped + 1


def test_a_cache_whose_stream_fell_behind_etcds_compaction_loads_again_in_pages_and_says_so(
    private_etcd: EmbeddedEtcd, settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache's client reaches etcd through a proxy, down when the cache starts (it loads
    once the proxy is up); then the proxy goes down again, another client changes segments
    and compacts etcd's history past them, the proxy comes back."""
    settings = replace(settings, etcd_endpoints=(private_etcd.endpoint,))
    writer = MetaStore.connect(settings)
    proxy = Endpoint(private_etcd.endpoint, tmp_path / "proxy.log")
    store = MetaStore.connect(settings, [proxy.url])
    cache = SegmentCache(store, fresh_timeout=1.0).start()
    store.segment_cache = cache
    try:
        # etcd unreachable at start: no load, and a listing fails as it does without a cache
        assert not cache.wait_loaded(1.0)
        with pytest.raises(MetaUnavailableError):
            SegmentMeta(store).list()
        proxy.start()
        assert cache.wait_loaded(60), "the cache did not load once etcd was back"
        info = CollectionInfo(1, "c", SCHEMA, (2,), ("dml_0_1v0",))
        write_segments(writer, info, "dml_0_1v0", 5, first=1_000)
        door, etcd = SegmentMeta(store), SegmentMeta(writer)
        assert listing(door.list()) == listing(etcd.list())

        proxy.kill()
        write_segments(writer, info, "dml_0_1v0", 5, first=2_000)
        etcd.delete(etcd.list()[0])
        writer.compact(writer.revision())
        with caplog.at_level(logging.WARNING), pytest.raises(MetaUnavailableError):
            door.list()  # no stale answer: the copy cannot prove it is current, etcd is down
        proxy.start()
        wait_until(lambda: cache.loads == 2, 60, "the cache loaded again", describe=lambda: cache.loads)
        assert "fell behind etcd's compaction" in caplog.text
        assert listing(door.list()) == listing(etcd.list())
        assert len(cache) == 9
    finally:
        cache.stop()
        proxy.kill()
        store.close()
        writer.close()


def test_the_datacoords_reload_seal_and_lifecycle_scans_read_no_segment_value_from_etcd(
    settings: Settings, store: MetaStore, cached: MetaStore, producer: Producer
) -> None:
    """Milvus' DataCoord answers from `meta.go`: with the cache, a meta reload after other
    clients changed segments, the seal of orphans, the sort scan and a GC pass read keys
    and the channels' state, not the collection's segment values (here 200 of ~1.9 KB)."""
    info = new_collection(producer)
    meta_bytes = write_segments(store, info, info.vchannels[0], 200, first=1_000)
    coordinator = DataCoordinator(settings, cached, reload_interval=0.0)
    assert coordinator.election.campaign(timeout=5.0)
    try:
        coordinator.tick()
        read = cached.bytes_read
        write_segments(store, info, info.vchannels[1], 5, first=2_000)  # another client's
        assert coordinator.tick().reloaded
        system = System(settings, cached, Storage.from_settings(settings))
        lifecycle_step(system, engine="local", compact=False)
        assert cached.bytes_read - read < meta_bytes / 10, "segment values were read from etcd"
    finally:
        coordinator.election.resign()


def test_the_first_reload_of_a_load_freezes_the_decoded_records_out_of_garbage_collection(
    settings: Settings, store: MetaStore, cached: MetaStore, producer: Producer
) -> None:
    """A full garbage collection walks every tracked object, and the decoded meta of
    100,000 segments is millions of them (2 s a pass): the DataCoord's first reload of a
    load, which decodes every record, moves them out of the collector's sight. A record
    decoded later (a change) is collected as usual until the next load, also by the next
    coordinator over the same copy (the Dagster host makes one per sensor tick)."""
    info = new_collection(producer)
    write_segments(store, info, info.vchannels[0], 20, first=1_000)
    coordinator = DataCoordinator(settings, cached, reload_interval=0.0)
    assert coordinator.election.campaign(timeout=5.0)
    try:
        coordinator.tick()  # (the term's first reload: at activation)
        loaded = [d.model for d in SegmentMeta(cached).list(info.id)]
        assert len(loaded) == 20
        tracked = {id(o) for o in gc.get_objects()}  # the collector's generations, not the frozen one
        assert not any(id(seg) in tracked for seg in loaded), "the loaded records are still collected"
    finally:
        coordinator.election.resign()

    write_segments(store, info, info.vchannels[1], 1, first=2_000)
    coordinator = DataCoordinator(settings, cached, reload_interval=0.0)
    assert coordinator.election.campaign(timeout=5.0)
    try:
        coordinator.tick()  # its first reload saw the new segment
        (new,) = [d.model for d in SegmentMeta(cached).list(info.id, vchannel=info.vchannels[1])]
        assert any(o is new for o in gc.get_objects()), "a record decoded after the load was frozen"
    finally:
        coordinator.election.resign()  # (tests/conftest.py unfreezes after each test)


def test_a_cached_reload_repairs_the_index_entries_of_what_changed_without_listing_the_index(
    settings: Settings, store: MetaStore, cached: MetaStore, producer: Producer
) -> None:
    """A process of the version before the per-vchannel index (a rolling upgrade) creates
    and deletes segment keys without their entries after the mark: the next reload of a
    DataCoord with the cache adds and removes those entries, reading only theirs."""
    info = new_collection(producer)
    vchannel = info.vchannels[0]
    write_segments(store, info, info.vchannels[1], 300, first=5_000)
    coordinator = DataCoordinator(settings, cached, reload_interval=0.0)
    assert coordinator.election.campaign(timeout=5.0)
    try:
        coordinator.tick()  # the term's first reload: a full repair
        writer = coordinator.writer
        assert writer is not None
        write_segments(store, info, vchannel, 5, first=700, indexed=False)
        read = writer.keys_read
        assert coordinator.tick().reloaded
        assert [d.model.id for d in SegmentMeta(store).list(info.id, vchannel=vchannel)] == [
            700,
            701,
            702,
            703,
            704,
        ]
        assert writer.keys_read - read < 60, "the reload listed the index"

        store.delete(store.keys.segment(info.id, info.partitions[0], 701))  # its entry left behind
        assert coordinator.tick().reloaded
        assert_channel_index_complete(store)
        assert [d.model.id for d in SegmentMeta(store).list(info.id, vchannel=vchannel)] == [
            700,
            702,
            703,
            704,
        ]
    finally:
        coordinator.election.resign()


def test_a_datacoord_killed_mid_load_never_led_and_the_next_one_loads_every_segment(
    store: MetaStore, producer: Producer, system: System, tmp_path: Path
) -> None:
    """Kill -9 of `vchan datacoord` in the middle of its segment cache's first load (one
    page of 1,000 segment keys read, more to come): the process had not campaigned yet (it
    loads before it campaigns; a copy still loading is never read: listings go to etcd until
    it is in), and the next one loads every segment, leads, and counts them all in its
    summary."""
    info = new_collection(producer)
    write_segments(store, info, info.vchannels[0], 1_500, first=10_000)  # two pages
    marker = tmp_path / "failpoint"
    env = cli_env(system.settings, VCHAN_LIFECYCLE_INTERVAL="3600", VCHAN_SORT_SCAN_INTERVAL="3600")
    first = subprocess.Popen(
        [str(VCHAN), "datacoord", "--engine", "local"],
        env={**env, "VCHAN_FAILPOINT": "meta_mid_walk=stop", "VCHAN_FAILPOINT_MARKER": str(marker)},
    )
    try:
        wait_until(lambda: marker.exists() and marker.read_text().startswith("meta_mid_walk"), 60, "the load")
        assert store.get(store.keys.datacoord_session()) is None, "campaigned with half its meta"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    second = subprocess.Popen([str(VCHAN), "datacoord", "--engine", "local"], env=env)

    def counted() -> int:
        found = store.get_model(store.keys.segment_summary(info.id), SegmentSummary)
        return sum(g.segments for g in found.model.groups) if found is not None else 0

    try:
        wait_until(
            lambda: counted() == 1_500, 90, "the next DataCoord's summary of every segment", describe=counted
        )
        assert store.get(store.keys.datacoord_session()) is not None
    finally:
        second.terminate()
        second.wait(30)


def test_etcd_killed_9_mid_the_datacoords_paged_load_then_back_it_loads_every_segment_and_leads(
    private_settings: Settings, private_store: MetaStore, private_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """kill -9 of etcd while `vchan datacoord` reads its segment cache's first load in pages
    (one page of 1,000 read, more to come): the process neither leads nor acts on the page it
    has; it says why and tries again, and once etcd is back it loads every segment, leads
    and counts them all in its summary."""
    system = System(private_settings, private_store, Storage.from_settings(private_settings))
    info = new_collection(Producer(system))
    write_segments(private_store, info, info.vchannels[0], 1_500, first=10_000)  # two pages
    marker = tmp_path / "failpoint"
    env = cli_env(private_settings, VCHAN_LIFECYCLE_INTERVAL="3600", VCHAN_SORT_SCAN_INTERVAL="3600")
    log_path = tmp_path / "datacoord.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [str(VCHAN), "datacoord", "--engine", "local"],
            env={**env, "VCHAN_FAILPOINT": "meta_mid_walk=stop-once", "VCHAN_FAILPOINT_MARKER": str(marker)},
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: marker.exists() and marker.read_text().startswith("meta_mid_walk"), 60, "the load")
        private_etcd.kill()
        os.kill(process.pid, signal.SIGCONT)  # its next page finds etcd gone
        said = "segment cache: watch of"  # "... interrupted (etcd ... unavailable ...); again in 0.1s"
        wait_until(lambda: said in log_path.read_text(), 60, "the cache to say its load failed")
        assert "interrupted" in log_path.read_text().split(said, 1)[1].splitlines()[0]
        assert process.poll() is None, log_path.read_text()[-2000:]
        private_etcd.restart()
        store = MetaStore.connect(private_settings)
        try:

            def counted() -> int:
                found = store.get_model(store.keys.segment_summary(info.id), SegmentSummary)
                return sum(g.segments for g in found.model.groups) if found is not None else 0

            wait_until(
                lambda: counted() == 1_500, 90, "the DataCoord's summary of every segment", describe=counted
            )
            assert store.get(store.keys.datacoord_session()) is not None
        finally:
            store.close()
    finally:
        process.kill()
        process.wait(30)
