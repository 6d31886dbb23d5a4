"""A read's plan from segment meta held in memory (`query.channel_plans`): the same segments
and query views as a plan listed from etcd, at every time and after every change another
client commits, with each vchannel planned again only when its own segments, the
collection's indexes or the read's time (before a drop or a ready stamp) call for it."""

from __future__ import annotations

import pickle
import time

import pytest

from vchan_assets.meta.allocator import now_ts
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    FieldIndex,
    IndexType,
    MetricType,
    MsgPosition,
    SegmentInfo,
    SegmentState,
)
from vchan_assets.query.asof import MetaAt, meta_at
from vchan_assets.query.channel_plans import ChannelSegments, HeldPlans, held_plans
from vchan_assets.testing.steps import flushed_segment, new_collection, write_segments
from vchan_assets.wal.producer import Producer


def test_a_held_plan_is_the_etcd_plan_at_every_time_and_plans_again_only_what_changed(
    store: MetaStore, cached: MetaStore, producer: Producer
) -> None:
    info = new_collection(producer)
    one, two = info.vchannels
    write_segments(store, info, one, 6, first=1_000)
    write_segments(store, info, two, 8, first=2_000)
    etcd = SegmentMeta(store)
    assert cached.segment_cache is not None
    plans: HeldPlans = held_plans(cached.segment_cache)

    def same(ts: int) -> MetaAt:
        """The held plan at `ts` is the plan listed from etcd, read nothing of segment meta
        from etcd, and is returned with how many vchannels it planned again."""
        from_etcd = meta_at(store, info, ts, builds=True)
        keys = cached.keys_read
        held = meta_at(cached, info, ts, builds=True)
        assert list(held.segments) == from_etcd.segments
        assert held.views == from_etcd.views
        assert held.indexes == from_etcd.indexes
        assert cached.keys_read - keys <= len(info.vchannels) + len(from_etcd.indexes)
        return held

    def planned(ts: int) -> tuple[int, int]:
        made, reused = plans.made, plans.reused
        same(ts)
        return plans.made - made, plans.reused - reused

    assert planned(now_ts(store)) == (2, 0)  # the first: both vchannels
    assert planned(now_ts(store)) == (0, 2)  # nothing changed: both kept for a later "now"

    # A sync on one vchannel: only it is planned again.
    first = etcd.list(info.id, vchannel=one)[0]
    etcd.swap(first.kv.version, first.model.with_changes(num_rows=first.model.num_rows + 1))
    assert planned(now_ts(store)) == (1, 1)
    etcd.create(flushed_segment(info, one, 1_500))
    assert planned(now_ts(store)) == (1, 1)

    # A checkpoint moves without a segment changing: the views follow it, the plans stay.
    checkpoint = MsgPosition(one, 12, now_ts(store))
    store.put(store.keys.channel_checkpoint(one), checkpoint)
    assert planned(now_ts(store)) == (0, 2)
    assert same(now_ts(store)).views[0].seek_position == checkpoint

    # A mix compaction on the other vchannel: before its drop stamp the inputs are read,
    # the output is not; after it, the output replaces them.
    before = now_ts(store)
    inputs = [d for d in etcd.list(info.id, vchannel=two) if d.model.id in (2_000, 2_001)]
    stamp = now_ts(store)
    for d in inputs:
        etcd.swap(
            d.kv.version,
            d.model.with_changes(state=SegmentState.DROPPED, dropped_at=time.time(), dropped_ts=stamp),
        )
    output = flushed_segment(info, two, 2_900).with_changes(compaction_from=(2_000, 2_001), ready_ts=stamp)
    etcd.create(output)
    at_before = same(before)
    assert {2_000, 2_001} <= at_before.views[1].flushed_ids and 2_900 not in at_before.views[1].flushed_ids
    after = now_ts(store)
    at_after = same(after)
    assert 2_900 in at_after.views[1].flushed_ids and not {2_000, 2_001} & at_after.views[1].flushed_ids
    assert planned(before) == (1, 1)  # the time before the stamps: planned for it
    assert planned(before) == (0, 2)  # the same time again: kept
    assert planned(now_ts(store)) == (1, 1)  # a time past them
    assert planned(now_ts(store)) == (0, 2)  # ... serves every later one

    # A new index: a mix output may now wait for it, so both vchannels are planned again.
    vector = info.schema.vector_fields[0]
    index = FieldIndex(
        77,
        info.id,
        "vec_idx",
        vector.field_id,
        vector.name,
        IndexType.HNSW,
        MetricType.L2,
        created_at=time.time(),
    )
    store.put(store.keys.field_index(info.id, 77), index)
    assert planned(now_ts(store)) == (2, 0)

    # Deleted segments, and a segment on a vchannel the collection does not name.
    for d in etcd.list(info.id, vchannel=one)[:3]:
        etcd.delete(d)
    etcd.create(flushed_segment(info, "elsewhere_v9", 3_000))
    held = same(now_ts(store))
    assert [v.vchannel for v in held.views] == [one, two, "elsewhere_v9"]
    assert planned(now_ts(store)) == (0, 3)


def test_the_segments_of_several_vchannels_read_as_one_sequence() -> None:
    """`ChannelSegments`: what a held plan returns as its segments, a list per vchannel read
    as one list would be (and pickled with a Spark reader)."""

    def seg(i: int, vchannel: str) -> SegmentInfo:
        return SegmentInfo(
            id=i, collection_id=1, partition_id=2, vchannel=vchannel, state=SegmentState.FLUSHED
        )

    parts = [[seg(1, "a"), seg(2, "a")], [], [seg(3, "b")]]
    flat = [s for part in parts for s in part]
    chained = ChannelSegments(parts)
    assert len(chained) == 3 and list(chained) == flat
    assert [chained[i] for i in range(-3, 3)] == flat + flat
    assert chained[1:] == flat[1:] and chained[::-1] == flat[::-1]
    assert seg(3, "b") in chained and seg(4, "b") not in chained
    with pytest.raises(IndexError):
        chained[3]
    assert list(pickle.loads(pickle.dumps(chained))) == flat
    assert len(ChannelSegments([])) == 0 and list(ChannelSegments([[], []])) == []
