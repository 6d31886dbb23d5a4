"""The DataCoord sensor is the coordinator: it campaigns in the election `vchan datacoord`
uses and runs the same tick (recovery of Flushing segments, seal policies, reconcile, the
meta reload and its segment summaries)."""

from __future__ import annotations

import time
from dataclasses import replace

import dagster as dg

from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.datacoord.segment_manager import SegmentManager
from vchan_assets.datacoord.segment_summary import summarize
from vchan_assets.defs.resources import VchanResource
from vchan_assets.meta.segment_cache import shared_segment_cache
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, SegmentState, SegmentSummary
from vchan_assets.testing.steps import reads, write_segments
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import NODE1, SCHEMA, CoordinatorTicks, evaluate, skip_message


def segment_states(store: MetaStore, collection: CollectionInfo) -> dict[int, SegmentState]:
    found = SegmentMeta(store).list(collection.id, include_dropped=True)
    return {d.model.id: d.model.state for d in found}


def test_the_sensor_recovers_flushing_segments_and_seals_by_policy(
    instance: dg.DagsterInstance,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    first, second = collection.vchannels
    producer.insert(collection.name, generate_rows(SCHEMA, 40, start_pk=1, seed=1))
    flush_ts = SegmentManager(store, dsettings).flush(collection.id)
    flushing = segment_states(store, collection)
    assert set(flushing.values()) == {SegmentState.FLUSHING}
    # The first channel's checkpoint passed the flush: its segments are complete.
    store.put(store.keys.channel_checkpoint(first), MsgPosition(first, 10_000, flush_ts + 1))
    producer.insert(collection.name, generate_rows(SCHEMA, 40, start_pk=100, seed=2))
    growing = set(segment_states(store, collection)) - set(flushing)
    assert growing
    short_life = VchanResource.from_settings(replace(dsettings, segment_max_life=1e-6))

    result = CoordinatorTicks(instance, short_life).tick()

    states = segment_states(store, collection)
    found = SegmentMeta(store).list(collection.id, include_dropped=True)
    channel_of = {d.model.id: d.model.vchannel for d in found}
    done = {SegmentState.FLUSHED, SegmentState.DROPPED}  # Dropped: a segment with no rows
    for seg in flushing:
        assert states[seg] in (done if channel_of[seg] == first else {SegmentState.FLUSHING})
    assert {states[seg] for seg in growing} == {SegmentState.SEALED}, result.skip_reason
    assert "recovered" in skip_message(result) and "sealed" in skip_message(result)


def test_the_sensor_stands_by_while_a_datacoord_process_leads_and_takes_over_after(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    collection: CollectionInfo,
) -> None:
    evaluate(NODE1, instance, vchan)  # a live DataNode to assign channels to
    process = DataCoordinator(dsettings, store)
    assert process.election.campaign(timeout=10)
    sensor = CoordinatorTicks(instance, vchan)
    watch_root = store.keys.channel_watch.prefix
    try:
        idle = sensor.tick()
        assert "standby" in skip_message(idle)
        assert store.list_prefix(watch_root).items == []  # the process leads: the sensor writes nothing

        process.election.resign()
        sensor.tick()
        assert len(store.list_prefix(watch_root).items) == len(collection.vchannels)

        # The sensor holds the term now: the process cannot win it until the sensor's
        # lease is gone (its ticks stopped past the TTL; here revoked at once).
        assert not process.election.try_acquire()
        from vchan_assets.defs.cluster.datacoord import CoordinatorCursor

        term = CoordinatorCursor.parse(sensor.cursor)
        store.revoke(term.lease_id)
        assert process.election.try_acquire()
        assert "standby" in skip_message(sensor.tick())
    finally:
        process.election.resign()


def test_the_sensors_reload_writes_the_segment_summary_vchan_status_reads(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    producer.insert(collection.name, generate_rows(SCHEMA, 40, start_pk=1, seed=1))

    CoordinatorTicks(instance, vchan).tick()

    found, _ = store.list_models(store.keys.segment_summary.prefix, SegmentSummary)
    [summary] = [d.model for d in found if d.model.collection_id == collection.id]
    listed = [d.model for d in SegmentMeta(store).list(collection.id)]
    assert summary.same_counts(summarize(listed, [collection.id], 0, 0.0)[collection.id])
    assert sum(g.segments for g in summary.groups) == len(listed) > 0


def test_the_sensors_ticks_share_the_processs_segment_cache_and_list_no_segment_of_etcd(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    store: MetaStore,
    dsettings: Settings,
    collection: CollectionInfo,
) -> None:
    """Each tick of the DataCoord sensor opens its own connection; the segment meta it
    reloads comes from one segment cache of the process (the code server's), loaded at the
    first tick and kept by its watch: a tick after another client created segments counts
    them all in the summary, and a listing through a tick's store reads no segment key."""
    vchannel = collection.vchannels[0]
    write_segments(store, collection, vchannel, 300, first=10_000)
    ticks = CoordinatorTicks(instance, vchan)
    ticks.tick()
    first_tick = time.monotonic()
    with vchan.open() as runtime:
        cache = shared_segment_cache(dsettings, runtime.store.endpoints)
    assert cache.started_at < first_tick, "the first tick did not start the process's segment cache"
    assert cache.wait_loaded(30), "the shared segment cache never loaded"
    write_segments(store, collection, vchannel, 5, first=20_000)
    loads = cache.loads

    def counted() -> int:
        found = store.get_model(store.keys.segment_summary(collection.id), SegmentSummary)
        return sum(g.segments for g in found.model.groups) if found is not None else 0

    wait_until(
        lambda: ticks.tick() and counted() == 305,
        30,
        "a reload counting the 5 new segments",
        describe=counted,
    )
    assert cache.loads == loads, "loaded again instead of following its watch"
    with vchan.open() as runtime:
        runtime.store.segment_cache = shared_segment_cache(dsettings, runtime.store.endpoints)
        keys, _ = reads(runtime.store, lambda: SegmentMeta(runtime.store).list(collection.id))
    assert keys == 0
