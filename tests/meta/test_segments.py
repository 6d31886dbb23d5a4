"""The door to segment meta: swaps by version, one conflict error, one policy for
malformed values."""

from __future__ import annotations

import pytest

from vchan_assets.meta.errors import CasConflictError, MalformedValueError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentInfo, SegmentLevel, SegmentState


def _segment(segment_id: int, state: SegmentState = SegmentState.GROWING) -> SegmentInfo:
    return SegmentInfo(
        id=segment_id, collection_id=1, partition_id=2, vchannel="c_0", state=state, level=SegmentLevel.L1
    )


def test_swap_returns_the_record_as_written_with_its_new_version(store: MetaStore) -> None:
    door = SegmentMeta(store)
    created = door.swap(0, _segment(7))
    assert created.kv.version == 1 and created.kv.create_revision == created.kv.mod_revision
    sealed = door.swap(created.kv.version, created.model.with_changes(state=SegmentState.SEALED))
    assert sealed.kv.version == 2 and sealed.kv.create_revision == created.kv.create_revision
    assert door.get(1, 2, 7) == sealed


def test_swap_against_a_stale_version_raises_one_conflict_naming_key_and_versions(store: MetaStore) -> None:
    door = SegmentMeta(store)
    first = door.swap(0, _segment(7))
    door.swap(first.kv.version, first.model.with_changes(num_rows=5))  # someone else's write
    with pytest.raises(CasConflictError) as lost:
        door.swap(first.kv.version, first.model.with_changes(state=SegmentState.DROPPED))
    assert (lost.value.key, lost.value.expected_version, lost.value.found_version) == (
        door.key(first.model),
        1,
        2,
    )
    assert str(lost.value) == f"conflict on {door.key(first.model)}: expected version 1, found 2"
    with pytest.raises(CasConflictError) as exists:
        door.swap(0, _segment(7))
    assert (exists.value.expected_version, exists.value.found_version) == (0, 2)


def test_delete_takes_the_vchannel_index_entry_with_the_segment_and_refuses_a_stale_version(
    store: MetaStore,
) -> None:
    door = SegmentMeta(store)
    created = door.swap(0, _segment(7))
    assert store.get(door.index_key(created.model)) is not None
    sealed = door.swap(created.kv.version, created.model.with_changes(state=SegmentState.SEALED))
    with pytest.raises(CasConflictError) as stale:
        door.delete(created)
    assert (stale.value.expected_version, stale.value.found_version) == (1, 2)
    door.delete(sealed)
    assert door.get(1, 2, 7) is None and store.get(door.index_key(created.model)) is None


def test_a_malformed_segment_raises_unless_the_listing_skips_it_and_counts_it(store: MetaStore) -> None:
    door = SegmentMeta(store)
    door.swap(0, _segment(7))
    bad = store.keys.segment(1, 2, 8)
    store.put(bad, b"not json")
    with pytest.raises(MalformedValueError) as malformed:
        door.list(1)
    assert malformed.value.key == bad
    before = store.malformed_skipped
    assert [d.model.id for d in door.list(1, skip_malformed=True)] == [7]
    assert store.malformed_skipped == before + 1


def test_changes_seen_moves_with_every_write_and_delete(store: MetaStore) -> None:
    door = SegmentMeta(store)
    empty = door.changes_seen()
    written = door.swap(0, _segment(7))
    assert door.changes_seen() == (written.kv.mod_revision, empty[1] + 1)
    store.delete(written.kv.key)
    assert door.changes_seen()[1] == empty[1]


def test_a_partition_is_listed_with_its_collection(store: MetaStore) -> None:
    with pytest.raises(TypeError, match="with its collection"):
        SegmentMeta(store).list(partition=2)
