"""The query view of a vchannel: which segments a reader sees, and as what.

Classification and lineage on SegmentInfo records built here; then the view of real
segments in a real etcd (produced, synced, flushed, sorted) and the rows read through it.
"""

from __future__ import annotations

import uuid
from collections import Counter

from vchan_assets import model
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.query.reads import read_collection
from vchan_assets.query.view import QueryView, collection_segments, query_view, read_query_view
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced, produce
from vchan_assets.testing.steps import new_collection, reads, sync_all, write_segments
from vchan_assets.wal.producer import Producer

V = "v0"
START = MsgPosition(V, -1, 0)
FLUSHED, DROPPED = SegmentState.FLUSHED, SegmentState.DROPPED


def seg(seg_id: int, state: SegmentState = FLUSHED, **fields: object) -> SegmentInfo:
    values: dict[str, object] = {"vchannel": V, "num_rows": 10, **fields}
    return SegmentInfo(seg_id, 1, 2, state=state, **values)  # type: ignore[arg-type]


def view(*segments: SegmentInfo, checkpoint: MsgPosition | None = None, ready: bool = True) -> QueryView:
    """The view; `ready=False`: no mix output is indexed yet (none replaces its inputs)."""
    return query_view(segments, V, checkpoint, START, lambda child: ready)


# --- classification ---------------------------------------------------------------------------


def test_growing_sealed_and_flushing_segments_are_served_as_growing() -> None:
    v = view(seg(1, SegmentState.GROWING), seg(2, SegmentState.SEALED), seg(3, SegmentState.FLUSHING))

    assert v.growing_ids == {1, 2, 3}
    assert not v.flushed and not v.l0 and not v.dropped


def test_an_invisible_flushed_segment_is_served_as_growing() -> None:
    v = view(seg(1, is_invisible=True))

    assert v.growing_ids == {1} and not v.flushed


def test_a_flushed_segment_is_served_as_flushed() -> None:
    assert view(seg(1), seg(2, level=SegmentLevel.L2)).flushed_ids == {1, 2}


def test_l0_segments_are_l0_and_never_flushed_or_growing() -> None:
    v = view(seg(1, level=SegmentLevel.L0), seg(2, SegmentState.FLUSHING, level=SegmentLevel.L0))

    assert v.l0_ids == {1, 2}
    assert not v.flushed and not v.growing


def test_a_dropped_segment_without_a_pending_output_stays_dropped() -> None:
    v = view(seg(1, DROPPED), seg(2, DROPPED, level=SegmentLevel.L0))

    assert v.dropped_ids == {1, 2}
    assert not v.flushed and not v.readable


def test_importing_segments_and_other_vchannels_segments_are_left_out() -> None:
    v = view(
        seg(1, SegmentState.IMPORTING), seg(2, vchannel="v1"), seg(3, SegmentState.GROWING, vchannel="v1")
    )

    assert v == QueryView(V, START)


def test_readable_segments_are_the_served_ones_with_binlogs() -> None:
    logs = (model.ColumnGroupBinlogs(0, (0, 1), (model.Binlog(9, "insert_log/x", 10, 1, 2, 100),)),)
    v = view(
        seg(1, binlogs=logs),
        seg(2),
        seg(3, SegmentState.GROWING, binlogs=logs),
        seg(4, DROPPED, binlogs=logs),
    )

    assert [s.id for s in v.readable] == [1, 3]


# --- compaction lineage -----------------------------------------------------------------------


def test_a_mix_output_replaces_its_inputs() -> None:
    v = view(seg(1, DROPPED), seg(2, DROPPED), seg(3, compaction_from=(1, 2), is_sorted=True, num_rows=5000))

    assert v.flushed_ids == {3} and v.dropped_ids == {1, 2}


def test_a_mix_output_not_yet_indexed_leaves_its_inputs_served() -> None:
    v = view(
        seg(1, DROPPED),
        seg(2, DROPPED),
        seg(3, compaction_from=(1, 2), is_sorted=True, num_rows=5000),
        ready=False,
    )

    assert v.flushed_ids == {1, 2} and not v.dropped


def test_inputs_are_found_through_lineage_recursively() -> None:
    # 1, 2 -> 3 (itself compacted with 4) -> 5: neither output is ready, so 1, 2 and 4 serve.
    v = view(
        seg(1, DROPPED),
        seg(2, DROPPED),
        seg(3, DROPPED, compaction_from=(1, 2)),
        seg(4, DROPPED),
        seg(5, compaction_from=(3, 4)),
        ready=False,
    )

    assert v.flushed_ids == {1, 2, 4} and v.dropped_ids == {3}


def test_an_invisible_compaction_output_is_skipped_and_its_inputs_stay_served() -> None:
    still_flushed = view(seg(1), seg(2), seg(3, compaction_from=(1, 2), is_invisible=True))
    already_dropped = view(
        seg(1, DROPPED), seg(2, DROPPED), seg(3, compaction_from=(1, 2), is_invisible=True)
    )

    for v in (still_flushed, already_dropped):
        assert v.flushed_ids == {1, 2}
        assert not v.growing and not v.dropped  # the output is in no class


def test_a_sort_output_replaces_its_invisible_input_at_once() -> None:
    dropped_input = view(
        seg(1, DROPPED, is_invisible=True), seg(2, compaction_from=(1,), is_sorted=True), ready=False
    )
    live_input = view(seg(1, is_invisible=True), seg(2, compaction_from=(1,), is_sorted=True), ready=False)

    assert dropped_input.flushed_ids == {2} and dropped_input.dropped_ids == {1}
    assert live_input.flushed_ids == {2} and not live_input.growing  # not served twice


def test_an_output_whose_inputs_are_still_flushed_is_not_served_twice() -> None:
    v = view(seg(1), seg(2), seg(3, compaction_from=(1, 2)))

    assert v.flushed_ids == {1, 2}


def test_an_output_whose_inputs_are_collected_is_served() -> None:
    assert view(seg(3, compaction_from=(1, 2)), ready=False).flushed_ids == {3}


# --- seek position ----------------------------------------------------------------------------


def test_the_seek_position_is_the_channel_checkpoint() -> None:
    checkpoint = MsgPosition(V, 40, 4000)
    v = view(seg(1, dml_position=MsgPosition(V, 5, 500)), checkpoint=checkpoint)

    assert v.seek_position == checkpoint


def test_without_a_checkpoint_the_seek_position_is_the_earliest_live_segment_position() -> None:
    v = view(
        seg(1, DROPPED, dml_position=MsgPosition(V, 1, 100)),  # dropped: not live
        seg(2, start_position=MsgPosition(V, 3, 300), dml_position=MsgPosition(V, 9, 900)),
        seg(3, SegmentState.GROWING, start_position=MsgPosition(V, 7, 700)),
        seg(4, SegmentState.IMPORTING, dml_position=MsgPosition(V, 0, 50)),  # importing: left out
    )

    assert v.seek_position == MsgPosition(V, 7, 700)  # 2's dml position, 3's start position


def test_without_a_checkpoint_or_a_segment_position_the_seek_position_is_the_collection_start() -> None:
    assert view(seg(1)).seek_position == START


# --- through etcd, with real segments ------------------------------------------------------------


def read_pks(system: System, info: CollectionInfo) -> Counter[int]:
    return Counter(read_collection(system, info, with_vectors=False)["pk"].to_pylist())


def test_the_view_of_synced_and_sorted_segments_and_the_rows_read_through_it(
    system: System, store: MetaStore, producer: Producer
) -> None:
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    (vchannel,) = info.vchannels
    assert read_query_view(store, info, vchannel).seek_position == info.start_positions[0]

    produced = Produced()
    for batch in range(2):  # one flushed L1 segment and one L0 segment per round
        produce(producer, info.name, produced, 200, start_pk=batch * 10_000, deletes=10)
        producer.flush(info.name)
        sync_all(system, info)
    produce(producer, info.name, produced, 50, start_pk=90_000)  # synced, not flushed: growing
    sync_all(system, info)
    expected = {pk for pk in produced.table["pk"].to_pylist() if pk not in set(produced.deleted)}

    before = read_query_view(store, info, vchannel)
    # The flush left both L1 segments Flushed and invisible: served as growing until sorted.
    flushed_invisible = {s.id for s in before.growing if s.state is FLUSHED and s.is_invisible}
    assert not before.flushed and len(before.l0) == 2 and len(before.growing) == 3
    assert len(flushed_invisible) == 2
    assert not any(s.is_invisible for s in before.l0)
    checkpoint = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    assert checkpoint is not None and before.seek_position == checkpoint.model
    counts = read_pks(system, info)
    assert set(counts) == expected and set(counts.values()) == {1}

    plans = CompactionTrigger(system).trigger(info, CompactionType.SORT)
    assert len(plans) == 2
    outcomes = CompactionExecutor(system, engine="local").run_pending()
    assert [o.state for o in outcomes] == [PlanState.COMPLETED] * 2

    after = read_query_view(store, info, vchannel)
    assert len(after.flushed) == 2 and all(s.is_sorted and not s.is_invisible for s in after.flushed)
    assert {s.compaction_from[0] for s in after.flushed} == flushed_invisible
    assert flushed_invisible <= after.dropped_ids
    assert after.growing_ids == before.growing_ids - flushed_invisible and after.l0_ids == before.l0_ids
    counts = read_pks(system, info)
    assert set(counts) == expected and set(counts.values()) == {1}


def test_the_view_of_one_vchannel_reads_that_vchannels_segments_only(
    store: MetaStore, producer: Producer
) -> None:
    """A view of one vchannel reads its own segments and dropped records (through its
    index), not its collection's: here 3 of 303 segments (it listed all of them, each time,
    whatever the collection's size); and it is the view the collection's listing gives."""
    info = new_collection(producer)
    busy, quiet = info.vchannels
    write_segments(store, info, busy, 300, first=1_000)
    write_segments(store, info, quiet, 3, first=5_000)
    door = SegmentMeta(store)
    for first in (1_000, 5_000):  # a dropped one on each: in the dropped family
        found = door.get(info.id, info.partitions[0], first)
        assert found is not None
        door.swap(found.kv.version, found.model.with_changes(state=SegmentState.DROPPED, dropped_at=1.0))

    keys, _ = reads(store, lambda: read_query_view(store, info, quiet))
    assert keys < 20, f"{keys} keys read for a view of 3 segments"
    view = read_query_view(store, info, quiet)
    whole = read_query_view(store, info, quiet, collection_segments(store, info.id))
    assert view == whole
    assert len(view.flushed) + len(view.growing) == 2 and [s.id for s in view.dropped] == [5_000]
