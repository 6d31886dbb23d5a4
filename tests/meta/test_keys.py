"""The etcd key layout, pinned: every key and prefix as it is written in etcd (a change here is
a change of the stored layout that running clusters would no longer find)."""

from __future__ import annotations

import pytest

from vchan_assets.meta import Keys

KEYS = Keys(root="c1/vchan")

LAYOUT = [
    (KEYS.datanode_session.prefix, "c1/vchan/session/datanode/"),
    (KEYS.datanode_session(7), "c1/vchan/session/datanode/7"),
    (KEYS.datacoord_session(), "c1/vchan/session/datacoord"),
    (KEYS.reader_session.prefix, "c1/vchan/session/reader/"),
    (KEYS.reader_session("host:12:ab"), "c1/vchan/session/reader/host:12:ab"),
    (KEYS.sessions(), "c1/vchan/session/"),
    (KEYS.channel_watch.prefix, "c1/vchan/channelwatch/"),
    (KEYS.channel_watch.under(7), "c1/vchan/channelwatch/7/"),
    (KEYS.channel_watch(7, "ch_0"), "c1/vchan/channelwatch/7/ch_0"),
    (KEYS.remaining_channel.prefix, "c1/vchan/channelwatch/remaining/"),
    (KEYS.remaining_channel("ch_0"), "c1/vchan/channelwatch/remaining/ch_0"),
    (KEYS.collection.prefix, "c1/vchan/meta/collection/"),
    (KEYS.collection(100), "c1/vchan/meta/collection/100"),
    (KEYS.segment.prefix, "c1/vchan/meta/segment/"),
    (KEYS.segment.under(100), "c1/vchan/meta/segment/100/"),
    (KEYS.segment.under(100, 1), "c1/vchan/meta/segment/100/1/"),
    (KEYS.segment(100, 1, 42), "c1/vchan/meta/segment/100/1/42"),
    (KEYS.channel_segment.prefix, "c1/vchan/meta/channel-segment/"),
    (KEYS.channel_segment.under("ch_0"), "c1/vchan/meta/channel-segment/ch_0/"),
    (KEYS.channel_segment.under("ch_0", 100), "c1/vchan/meta/channel-segment/ch_0/100/"),
    (KEYS.channel_segment("ch_0", 100, 1, 42), "c1/vchan/meta/channel-segment/ch_0/100/1/42"),
    (KEYS.channel_segment_index(), "c1/vchan/meta/channel-segment-index"),
    (KEYS.channel_checkpoint.prefix, "c1/vchan/meta/channel-cp/"),
    (KEYS.channel_checkpoint("ch_0"), "c1/vchan/meta/channel-cp/ch_0"),
    (KEYS.channel_lease.prefix, "c1/vchan/meta/channel-lease/"),
    (KEYS.channel_lease("ch_0"), "c1/vchan/meta/channel-lease/ch_0"),
    (KEYS.channel_sync("ch_0"), "c1/vchan/meta/channel-sync/ch_0"),
    (KEYS.compaction_plan.prefix, "c1/vchan/meta/compaction/"),
    (KEYS.compaction_plan(5), "c1/vchan/meta/compaction/5"),
    (KEYS.field_index.prefix, "c1/vchan/meta/field-index/"),
    (KEYS.field_index.under(100), "c1/vchan/meta/field-index/100/"),
    (KEYS.field_index(100, 8), "c1/vchan/meta/field-index/100/8"),
    (KEYS.segment_index.prefix, "c1/vchan/meta/segment-index/"),
    (KEYS.segment_index.under(100), "c1/vchan/meta/segment-index/100/"),
    (KEYS.segment_index.under(100, 1, 42), "c1/vchan/meta/segment-index/100/1/42/"),
    (KEYS.segment_index(100, 1, 42, 9), "c1/vchan/meta/segment-index/100/1/42/9"),
    (KEYS.task.prefix, "c1/vchan/meta/task/"),
    (KEYS.task.under("index"), "c1/vchan/meta/task/index/"),
    (KEYS.task("sort", 100, 42), "c1/vchan/meta/task/sort/100/42"),
    (KEYS.import_job.prefix, "c1/vchan/meta/import/"),
    (KEYS.import_job(6), "c1/vchan/meta/import/6"),
    (KEYS.read_pin.prefix, "c1/vchan/meta/read-pin/"),
    (KEYS.read_pin(7), "c1/vchan/meta/read-pin/7"),
    (KEYS.stream.prefix, "c1/vchan/meta/stream/"),
    (KEYS.stream("orders-cdc"), "c1/vchan/meta/stream/orders-cdc"),
    (KEYS.data_loss.prefix, "c1/vchan/meta/data-loss/"),
    (KEYS.data_loss.under(100), "c1/vchan/meta/data-loss/100/"),
    (KEYS.data_loss(100, 12), "c1/vchan/meta/data-loss/100/12"),
    (KEYS.gc_pause(), "c1/vchan/meta/gc/pause"),
    (KEYS.gc_last_run(), "c1/vchan/meta/gc/last-run"),
    (KEYS.id_allocator(), "c1/vchan/meta/id"),
    (KEYS.tso(), "c1/vchan/meta/tso"),
    (KEYS.wal_lock("ch_0"), "c1/vchan/wal-lock/ch_0"),
    (KEYS.wal_head.prefix, "c1/vchan/wal-head/"),
    (KEYS.wal_head("ch_0"), "c1/vchan/wal-head/ch_0"),
]


@pytest.mark.parametrize(("built", "expected"), LAYOUT, ids=[e for _, e in LAYOUT])
def test_the_key_layout_is_byte_identical(built: str, expected: str) -> None:
    assert built == expected


def test_the_default_root_is_vchan() -> None:
    assert Keys().segment(1, 2, 3) == "vchan/meta/segment/1/2/3"


def test_a_key_needs_all_its_ids_and_a_range_fewer() -> None:
    with pytest.raises(TypeError, match=r"c1/vchan/meta/segment/\{collection\}/\{partition\}/\{segment\}"):
        KEYS.segment(100, 1)
    with pytest.raises(TypeError, match="fewer than 2 ids"):
        KEYS.channel_watch.under(7, "ch_0")
