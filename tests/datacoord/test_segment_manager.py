"""DataCoord's segment manager: allocation, seal policies, flush, flush state, recovery."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.segment_manager import MiB, SegmentManager, max_rows_of, seal_by_lifetime
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    Binlog,
    CollectionInfo,
    CollectionSchema,
    ColumnGroupBinlogs,
    MsgPosition,
    SegmentInfo,
    SegmentState,
)

SCHEMA = CollectionSchema.build("id", {"vector": 4}, {"age": "int64"})
T0 = 1_700_000_000.0  # wall-clock seconds; passed explicitly, nothing sleeps


@pytest.fixture
def dc_settings(settings: Settings) -> Settings:
    return replace(
        settings,
        segment_max_size_mb=(100 * SCHEMA.row_bytes() + 1) / MiB,  # 100 rows per segment
        segment_seal_proportion=0.5,
        segment_max_life=3600.0,
        segment_max_idle=60.0,
    )


@pytest.fixture
def collection(store: MetaStore) -> CollectionInfo:
    return CollectionRegistry(store).create("docs", SCHEMA, ["news"], num_channels=2)


@pytest.fixture
def manager(store: MetaStore, dc_settings: Settings, collection: CollectionInfo) -> SegmentManager:
    return SegmentManager(store, dc_settings, clock=lambda: T0)


def segments(store: MetaStore, collection: CollectionInfo) -> dict[int, SegmentInfo]:
    """Every segment of `collection`, the Dropped ones (in their own family) included."""
    found = SegmentMeta(store).list(collection.id, include_dropped=True)
    return {d.model.id: d.model for d in found}


def node_writes(store: MetaStore, seg: SegmentInfo, **changes: object) -> SegmentInfo:
    """What a DataNode sync commits for a segment (a CAS on the version it read)."""
    key = store.keys.segment(seg.collection_id, seg.partition_id, seg.id)
    found = store.get_model(key, SegmentInfo)
    assert found is not None
    new = found.model.with_changes(**changes)
    store.cas(key, found.kv.version, new)
    return new


def checkpoint(store: MetaStore, vchannel: str, offset: int, ts: int) -> None:
    store.put(store.keys.channel_checkpoint(vchannel), MsgPosition(vchannel, offset, ts))


def test_capacity_is_the_max_segment_size_over_the_row_size(
    dc_settings: Settings, collection: CollectionInfo
) -> None:
    assert max_rows_of(collection, dc_settings) == 100
    assert max_rows_of(collection, Settings()) == 1024 * MiB // SCHEMA.row_bytes()


def test_assign_opens_a_growing_segment_in_etcd(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    part, ch = collection.partitions[0], collection.vchannels[0]

    [(segment_id, rows)] = manager.assign(collection.id, part, ch, 10, ts=manager.tso.now(), now=T0)

    assert rows == 10
    key = store.keys.segment(collection.id, part, segment_id)
    found = store.get_model(key, SegmentInfo)
    assert found is not None and found.kv.version == 1
    seg = found.model
    assert (seg.state, seg.max_rows, seg.created_at, seg.start_position) == (
        SegmentState.GROWING,
        100,
        T0,
        None,
    )
    assert (seg.vchannel, seg.partition_id, seg.num_rows) == (ch, part, 0)


def test_assign_fills_the_open_segment_then_spills_and_seals_the_full_one(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    part, ch = collection.partitions[0], collection.vchannels[0]
    [(a, _)] = manager.assign(collection.id, part, ch, 60, ts=manager.tso.now(), now=T0)

    ts = manager.tso.now()
    spilled = manager.assign(collection.id, part, ch, 160, ts=ts, now=T0)

    assert spilled[0] == (a, 40)
    assert [n for _, n in spilled[1:]] == [100, 20]
    meta = segments(store, collection)
    full = [meta[a], meta[spilled[1][0]]]
    assert all(s.state is SegmentState.SEALED and s.seal_ts > ts for s in full)
    assert meta[spilled[2][0]].state is SegmentState.GROWING
    assert [s.segment_id for s in manager.growing()] == [spilled[2][0]]


def test_each_partition_and_channel_has_its_own_growing_segment(
    manager: SegmentManager, collection: CollectionInfo
) -> None:
    ts = manager.tso.now()
    ids = {
        (part, ch): manager.assign(collection.id, part, ch, 1, ts, now=T0)[0][0]
        for part in collection.partitions
        for ch in collection.vchannels
    }

    assert len(set(ids.values())) == 4


def test_seal_by_size_once_allocated_rows_reach_the_seal_proportion(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    part, ch = collection.partitions[0], collection.vchannels[0]
    [(a, _)] = manager.assign(collection.id, part, ch, 49, ts=manager.tso.now(), now=T0)
    assert manager.seal_by_policy(now=T0) == []

    manager.assign(collection.id, part, ch, 1, ts=manager.tso.now(), now=T0)
    [sealed] = manager.seal_by_policy(now=T0)

    assert sealed.segment_id == a and sealed.reason.startswith("capacity")
    assert segments(store, collection)[a].state is SegmentState.SEALED
    assert manager.assign(collection.id, part, ch, 1, ts=manager.tso.now(), now=T0)[0][0] != a


def test_seal_by_lifetime(store: MetaStore, dc_settings: Settings, collection: CollectionInfo) -> None:
    manager = SegmentManager(store, dc_settings, policies=[seal_by_lifetime(3600.0)])
    manager.assign(
        collection.id, collection.partitions[0], collection.vchannels[0], 1, manager.tso.now(), now=T0
    )

    assert manager.seal_by_policy(now=T0 + 3599) == []
    [sealed] = manager.seal_by_policy(now=T0 + 3600)
    assert sealed.reason.startswith("lifetime")


def test_seal_by_idle_time_since_the_last_insert(manager: SegmentManager, collection: CollectionInfo) -> None:
    part, ch = collection.partitions[0], collection.vchannels[0]
    manager.assign(collection.id, part, ch, 1, manager.tso.now(), now=T0)
    manager.assign(collection.id, part, ch, 1, manager.tso.now(), now=T0 + 30)

    assert manager.seal_by_policy(now=T0 + 80) == []
    [sealed] = manager.seal_by_policy(now=T0 + 90)
    assert sealed.reason.startswith("idle")


def test_flush_seals_every_growing_segment_after_every_assigned_timestamp(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    stamps = []
    for part in collection.partitions:
        for ch in collection.vchannels:
            stamps.append(manager.tso.now())
            manager.assign(collection.id, part, ch, 5, stamps[-1], now=T0)

    flush_ts = manager.flush(collection.id)

    meta = segments(store, collection)
    assert len(meta) == 4
    assert all(s.state is SegmentState.FLUSHING and s.seal_ts == flush_ts for s in meta.values())
    assert flush_ts > max(stamps)
    assert manager.growing(collection.id) == []
    new_id = manager.assign(
        collection.id, collection.partitions[0], collection.vchannels[0], 1, manager.tso.now()
    )
    assert new_id[0][0] not in meta


def test_flush_moves_segments_sealed_by_policy_to_flushing_keeping_their_seal_ts(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    manager.assign(
        collection.id, collection.partitions[0], collection.vchannels[0], 50, manager.tso.now(), now=T0
    )
    [sealed] = manager.seal_by_policy(now=T0)

    flush_ts = manager.flush(collection.id)

    seg = segments(store, collection)[sealed.segment_id]
    assert seg.state is SegmentState.FLUSHING
    assert seg.seal_ts == sealed.seal_ts < flush_ts


def test_flush_state_turns_true_once_checkpoints_pass_and_segments_are_flushed(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    for ch in collection.vchannels:
        manager.assign(collection.id, collection.partitions[0], ch, 5, manager.tso.now(), now=T0)
    flush_ts = manager.flush(collection.id)
    assert manager.flush_state(collection.id, flush_ts) is False  # no checkpoint yet

    for i, ch in enumerate(collection.vchannels):
        checkpoint(store, ch, 10 + i, flush_ts - 1)
    assert manager.flush_progress(collection.id, flush_ts).lagging_channels == tuple(
        (ch, flush_ts - 1) for ch in collection.vchannels
    )

    for i, ch in enumerate(collection.vchannels):
        checkpoint(store, ch, 20 + i, flush_ts + 1)
    progress = manager.flush_progress(collection.id, flush_ts)
    assert not progress.done and progress.lagging_channels == ()
    assert set(progress.pending_segments) == set(segments(store, collection))

    for seg in segments(store, collection).values():  # what the DataNode sync does
        node_writes(store, seg, state=SegmentState.FLUSHED, num_rows=5)
    assert manager.flush_state(collection.id, flush_ts) is True
    # Segments opened after the flush do not hold it back.
    manager.assign(collection.id, collection.partitions[0], collection.vchannels[0], 1, manager.tso.now())
    assert manager.flush_state(collection.id, flush_ts) is True


def test_two_managers_share_one_allocation_in_etcd_exactly(
    manager: SegmentManager, store: MetaStore, dc_settings: Settings, collection: CollectionInfo
) -> None:
    part, ch = collection.partitions[0], collection.vchannels[0]
    [(a, _)] = manager.assign(collection.id, part, ch, 30, manager.tso.now(), now=T0)
    other = SegmentManager(store, dc_settings, clock=lambda: T0)  # another process, say

    [allocation] = other.growing()
    assert (allocation.segment_id, allocation.allocated, allocation.max_rows) == (a, 30, 100)
    spilled = other.assign(collection.id, part, ch, 90, other.tso.now(), now=T0)
    assert spilled[0] == (a, 70) and spilled[1][1] == 20
    assert segments(store, collection)[a].state is SegmentState.SEALED  # full: sealed by `other`
    assert [s.segment_id for s in manager.growing()] == [spilled[1][0]]


def test_a_segment_sealed_by_one_manager_gets_no_rows_from_another(
    manager: SegmentManager, store: MetaStore, dc_settings: Settings, collection: CollectionInfo
) -> None:
    part, ch = collection.partitions[0], collection.vchannels[0]
    ts = manager.tso.now()
    [(a, _)] = manager.assign(collection.id, part, ch, 5, ts, now=T0)
    other = SegmentManager(store, dc_settings, clock=lambda: T0)

    flush_ts = other.flush(collection.id)
    [(b, _)] = manager.assign(collection.id, part, ch, 5, manager.tso.now(), now=T0)

    assert b != a
    sealed = segments(store, collection)[a]
    assert sealed.state is SegmentState.FLUSHING and ts < sealed.seal_ts <= flush_ts
    assert other.heads.read(ch) is not None and other.heads.read(ch).last_ts >= sealed.seal_ts  # type: ignore[union-attr]


def test_a_growing_segment_on_no_channel_head_is_sealed_as_an_orphan(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    part, ch = collection.partitions[0], collection.vchannels[0]
    ts = manager.tso.now()
    [(a, _)] = manager.assign(collection.id, part, ch, 5, ts, now=T0)
    # What a sealer killed between taking it off the head and sealing it leaves behind.
    with manager.heads.hold(ch) as held:
        held.commit(replace(held.head, open_segments=()))

    [sealed] = manager.seal_orphans()

    assert sealed.segment_id == a and sealed.seal_ts > ts
    assert segments(store, collection)[a].state is SegmentState.SEALED


def test_sealing_keeps_everything_the_datanode_wrote(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    [(a, _)] = manager.assign(
        collection.id, collection.partitions[0], collection.vchannels[0], 5, manager.tso.now()
    )
    binlog = Binlog(7, "insert_log/x/7.parquet", 5, 1, 2, 1234)
    written = node_writes(
        store,
        segments(store, collection)[a],
        num_rows=5,
        binlogs=(ColumnGroupBinlogs(0, (0, 1, 100), (binlog,)),),
        dml_position=MsgPosition(collection.vchannels[0], 6, 99),
    )

    flush_ts = manager.flush(collection.id)

    assert segments(store, collection)[a] == written.with_changes(
        state=SegmentState.FLUSHING, seal_ts=flush_ts
    )


def test_a_segment_write_retries_when_the_datanode_changed_it_meanwhile(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    [(a, _)] = manager.assign(
        collection.id, collection.partitions[0], collection.vchannels[0], 5, manager.tso.now()
    )
    key = store.keys.segment(collection.id, collection.partitions[0], a)
    calls = []

    def seal(seg: SegmentInfo) -> SegmentInfo:
        calls.append(seg)
        if len(calls) == 1:  # the node commits between our read and our write
            node_writes(store, seg, num_rows=5, dml_position=MsgPosition(collection.vchannels[0], 6, 99))
        return seg.with_changes(state=SegmentState.SEALED, seal_ts=1234)

    result = manager.update_segment(key, seal)

    assert len(calls) == 2 and manager.cas_retries == 1
    stored = store.get_model(key, SegmentInfo)
    assert stored is not None and stored.model == result
    assert (result.state, result.seal_ts, result.num_rows) == (SegmentState.SEALED, 1234, 5)
    assert result.dml_position == MsgPosition(collection.vchannels[0], 6, 99)


def test_recover_flushing_completes_segments_whose_checkpoint_passed_their_seal_ts(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    ch0, ch1 = collection.vchannels
    part = collection.partitions[0]
    [(with_rows, _)] = manager.assign(collection.id, part, ch0, 5, manager.tso.now())
    [(empty, _)] = manager.assign(collection.id, part, ch1, 5, manager.tso.now())
    node_writes(store, segments(store, collection)[with_rows], num_rows=5)
    flush_ts = manager.flush(collection.id)
    checkpoint(store, ch0, 40, flush_ts + 1)
    checkpoint(store, ch1, 40, flush_ts - 1)

    report = {r.segment_id: r.action for r in manager.recover_flushing()}

    assert report == {with_rows: "flushed", empty: "pending"}
    meta = segments(store, collection)
    assert meta[with_rows].state is SegmentState.FLUSHED
    assert meta[with_rows].dml_position == MsgPosition(ch0, 40, flush_ts + 1)
    assert meta[empty].state is SegmentState.FLUSHING

    checkpoint(store, ch1, 41, flush_ts + 2)
    assert {r.segment_id: r.action for r in manager.recover_flushing()} == {empty: "dropped"}
    assert manager.flush_state(collection.id, flush_ts) is True


def test_dropping_a_partition_drops_its_segments_only(
    manager: SegmentManager, store: MetaStore, collection: CollectionInfo
) -> None:
    default, news = collection.partitions
    ch = collection.vchannels[0]
    [(kept, _)] = manager.assign(collection.id, default, ch, 5, manager.tso.now())
    [(gone, _)] = manager.assign(collection.id, news, ch, 5, manager.tso.now())

    assert manager.drop_partition(collection.id, news) == [gone]

    meta = segments(store, collection)
    assert meta[gone].state is SegmentState.DROPPED
    assert meta[kept].state is SegmentState.GROWING
    assert [s.segment_id for s in manager.growing()] == [kept]
    assert sorted(manager.drop_collection(collection.id)) == [kept]
    assert manager.growing() == []
