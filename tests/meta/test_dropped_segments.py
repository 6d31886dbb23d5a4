"""Dropped segments leave the live family: the drop moves a segment's record to
`meta/dropped/...` in one transaction guarded on its live version, live listings (the
door's default, the per-vchannel index, the segment cache) hold live segments only, and
the readers that need the dropped ones list both families at one revision. Dropped
segments an older version left among the live ones are listed as dropped and moved over
in bounded transactions."""

from __future__ import annotations

import pytest

from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.segments import MOVE_BATCH, SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import SegmentInfo, SegmentLevel, SegmentState


def _segment(
    segment_id: int, state: SegmentState = SegmentState.FLUSHED, vchannel: str = "c_0"
) -> SegmentInfo:
    return SegmentInfo(
        id=segment_id, collection_id=1, partition_id=2, vchannel=vchannel, state=state, level=SegmentLevel.L1
    )


def _dropped(seg: SegmentInfo) -> SegmentInfo:
    return seg.with_changes(state=SegmentState.DROPPED, dropped_at=1.0)


def _ids(found: list[Decoded[SegmentInfo]]) -> list[int]:
    return [d.model.id for d in found]


def _write_as_an_older_version(store: MetaStore, segments: list[SegmentInfo]) -> None:
    """Dropped records where the version before the dropped family left them: at their live
    keys, with their index entries."""
    door = SegmentMeta(store)
    for seg in segments:
        store.txn({}, door.create_puts(seg))


def test_a_drop_moves_the_record_out_of_every_live_listing_in_one_transaction(store: MetaStore) -> None:
    door = SegmentMeta(store)
    kept = door.create(_segment(7))
    gone = door.create(_segment(8))
    before = store.revision()

    moved = door.swap(gone.kv.version, _dropped(gone.model))

    assert moved.kv.key == door.dropped_key(gone.model) and moved.kv.mod_revision == before + 1
    assert store.get(door.key(gone.model)) is None and store.get(door.index_key(gone.model)) is None
    assert _ids(door.list(1)) == _ids(door.list(1, vchannel="c_0")) == [7]
    assert _ids(door.list(1, include_dropped=True)) == _ids(
        door.list(1, vchannel="c_0", include_dropped=True)
    )
    assert _ids(door.list(1, include_dropped=True)) == [7, 8]
    assert door.get(1, 2, 8) is None and door.get(1, 2, 8, include_dropped=True) == moved
    assert door.get(1, 2, 7) == kept


def test_a_vchannels_listing_with_the_dropped_reads_only_that_vchannels_dropped_records(
    store: MetaStore,
) -> None:
    """What a sync lists (its vchannel's segments, the Dropped ones included) reads no
    dropped record of another vchannel of its collection: the dropped family is keyed by
    vchannel. Under steady load a collection keeps thousands of dropped records for the GC
    tolerance; a sync of one vchannel must not read the others'."""
    door = SegmentMeta(store)
    mine = door.create(_segment(7, vchannel="c_0"))
    door.swap(mine.kv.version, _dropped(mine.model))
    for i in range(100, 150):  # another vchannel's drops
        other = door.create(_segment(i, vchannel="c_1"))
        door.swap(other.kv.version, _dropped(other.model))
    keys, size = store.keys_read, store.bytes_read

    found = door.list(1, vchannel="c_0", include_dropped=True)

    assert _ids(found) == [7]
    read = store.keys_read - keys
    assert read < 10, f"read {read} keys ({store.bytes_read - size} bytes) for one dropped record"
    assert len(door.list(1, include_dropped=True)) == 51
    assert door.get(1, 2, 120, include_dropped=True) is not None  # without its vchannel: found
    assert door.get(1, 2, 120, include_dropped=True, vchannel="c_1") is not None


def test_a_drop_against_a_stale_version_moves_nothing(store: MetaStore) -> None:
    door = SegmentMeta(store)
    first = door.create(_segment(7))
    door.swap(first.kv.version, first.model.with_changes(num_rows=5))  # someone else's write

    with pytest.raises(CasConflictError) as lost:
        door.swap(first.kv.version, _dropped(first.model))

    assert (lost.value.key, lost.value.expected_version, lost.value.found_version) == (
        door.key(first.model),
        1,
        2,
    )
    assert store.get(door.dropped_key(first.model)) is None
    assert _ids(door.list(1)) == [7] and store.get(door.index_key(first.model)) is not None


def test_a_dropped_segment_is_never_created_again(store: MetaStore) -> None:
    door = SegmentMeta(store)
    created = door.create(_segment(7, SegmentState.GROWING))
    door.swap(created.kv.version, _dropped(created.model))

    with pytest.raises(CasConflictError) as again:
        door.create(_segment(7, SegmentState.GROWING))

    assert again.value.key == door.dropped_key(created.model)
    assert door.list(1) == [] and store.get(door.index_key(created.model)) is None


def test_writes_of_a_dropped_segment_move_it_in_the_callers_transaction(store: MetaStore) -> None:
    door = SegmentMeta(store)
    a, b = door.create(_segment(7)), door.create(_segment(8))
    puts, deletes = {}, []
    for d in (a, b):
        written, gone = door.writes(_dropped(d.model))
        puts.update(written)
        deletes += gone

    assert store.txn({a.kv.key: a.kv.version, b.kv.key: b.kv.version}, puts, deletes) is not None

    assert door.list(1) == [] and _ids(door.list(1, include_dropped=True)) == [7, 8]


def test_gc_deletes_a_dropped_record_by_its_version(store: MetaStore) -> None:
    door = SegmentMeta(store)
    created = door.create(_segment(7))
    moved = door.swap(created.kv.version, _dropped(created.model))

    door.delete(moved)

    assert door.list(1, include_dropped=True) == [] and door.get(1, 2, 7, include_dropped=True) is None


def test_a_dropped_segment_left_live_by_an_older_version_is_listed_as_dropped(store: MetaStore) -> None:
    door = SegmentMeta(store)
    door.create(_segment(7))
    _write_as_an_older_version(store, [_dropped(_segment(8))])

    assert _ids(door.list(1)) == _ids(door.list(1, vchannel="c_0")) == [7]
    assert _ids(door.list(1, include_dropped=True)) == [7, 8]
    assert door.get(1, 2, 8) is None and door.get(1, 2, 8, include_dropped=True) is not None


def test_dropped_segments_left_live_are_moved_in_bounded_transactions(store: MetaStore) -> None:
    door = SegmentMeta(store)
    door.create(_segment(1))
    old = [_dropped(_segment(i, vchannel=f"c_{i % 2}")) for i in range(100, 100 + 2 * MOVE_BATCH + 5)]
    _write_as_an_older_version(store, old)
    listed = door.list(1, include_dropped=True)
    before = store.revision()

    moved = door.move_dropped(listed)

    assert moved == len(old) and store.revision() == before + 3  # 40 + 40 + 5, a transaction each
    assert _ids(door.list(1)) == [1]
    assert _ids(door.list(1, include_dropped=True)) == [1, *(s.id for s in old)]
    assert all(store.get(door.index_key(s)) is None for s in old)
    assert door.move_dropped(door.list(1, include_dropped=True)) == 0  # nothing left: run again, a no-op


def test_a_record_changed_since_the_listing_is_left_for_the_next_move(store: MetaStore) -> None:
    door = SegmentMeta(store)
    old = [_dropped(_segment(i)) for i in (100, 101, 102)]
    _write_as_an_older_version(store, old)
    listed = door.list(1, include_dropped=True)
    store.put(door.key(old[1]), old[1].with_changes(dropped_at=2.0))  # changed after the listing

    assert door.move_dropped(listed) == 2
    assert door.list(1) == [] and _ids(door.list(1, include_dropped=True)) == [100, 101, 102]
    assert door.move_dropped(door.list(1, include_dropped=True)) == 1


def test_the_segment_cache_follows_both_families_and_lists_the_dropped_without_reading_etcd(
    store: MetaStore, cached: MetaStore
) -> None:
    """The segment cache follows the dropped family too (it did not: every listing with the
    Dropped segments, the DataCoord's reload each time segments changed, read the whole
    dropped family from etcd): a live listing through it leaves the Dropped segment out,
    one with them adds it, and neither reads a segment value from etcd."""
    door = SegmentMeta(store)
    created = [door.create(_segment(i)) for i in (7, 8, 9)]
    door.swap(created[1].kv.version, _dropped(created[1].model))

    through_cache = SegmentMeta(cached)
    read = cached.bytes_read
    assert _ids(through_cache.list(1)) == [7, 9]
    assert _ids(through_cache.list(1, include_dropped=True)) == [7, 8, 9]
    assert through_cache.dropped_changes_seen()[1] == 1
    assert cached.bytes_read - read < 200, "segment values were read from etcd"
    assert cached.segment_cache is not None and len(cached.segment_cache) == 3
