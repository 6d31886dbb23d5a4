"""The one door to segment meta, `meta/segment/{collection}/{partition}/{segment}`.

Milvus' DataCoord reads and writes segments through its `meta.go` behind a catalog; here
every listing of segment meta goes through `SegmentMeta`, so paging, filters and the
policy for malformed values live in one place:

- listings are paged reads of etcd (`MetaStore.list_prefix`, Milvus' `WalkWithPrefix`):
  one snapshot at one revision however many segments a collection holds;
- a partition is ranged by its own prefix; a vchannel or state filter is applied to the
  collection's listing;
- a value that does not decode raises `MalformedValueError` naming its key, unless the
  caller lists with `skip_malformed` (readers and schedulers that go on without it): the
  value is then logged and counted in `MetaStore.malformed_skipped`. Garbage collection,
  which deletes the files no listed segment names, lists strictly;
- `swap` is a compare-version-and-swap that returns the record as written, or raises
  `CasConflictError` naming the key, the version expected and the version found.
"""

from __future__ import annotations

import builtins
from collections.abc import Collection, Sequence

from vchan_assets.meta.store import Decoded, KeyValue, MetaStore
from vchan_assets.model import SegmentInfo, SegmentState


class SegmentMeta:
    """Segment meta in etcd, listed in pages and swapped by version."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store

    def key(self, segment: SegmentInfo) -> str:
        return self.store.keys.segment(segment.collection_id, segment.partition_id, segment.id)

    def prefix(self, collection: int | None = None, partition: int | None = None) -> str:
        """The range of a partition, a collection, or every segment (no collection)."""
        family = self.store.keys.segment
        if partition is not None:
            if collection is None:
                raise TypeError("a partition's segments are listed with its collection")
            return family.under(collection, partition)
        return family.prefix if collection is None else family.under(collection)

    def list(
        self,
        collection: int | None = None,
        *,
        vchannel: str | None = None,
        partition: int | None = None,
        states: Collection[SegmentState] | None = None,
        skip_malformed: bool = False,
    ) -> list[Decoded[SegmentInfo]]:
        """The segments of a collection (every collection's without one), with their etcd
        versions, in key order, at one revision; only those of `vchannel`, `partition`
        and `states` when given."""
        snapshot = self.store.list_prefix(self.prefix(collection, partition))
        return self._select(snapshot.items, vchannel, states, skip_malformed)

    def list_with(
        self, collection: int, prefixes: Sequence[str], skip_malformed: bool = False
    ) -> tuple[builtins.list[Decoded[SegmentInfo]], builtins.list[builtins.list[KeyValue]]]:
        """The collection's segments and the keys under each of `prefixes`, all read at one
        revision (a read's segments and the indexes of those very segments)."""
        segments, *others = self.store.list_prefixes([self.prefix(collection), *prefixes])
        return self._select(segments, None, None, skip_malformed), others

    def changes_seen(self) -> tuple[int, int]:
        """(the highest mod revision, the count) of every segment key, read keys only: it
        moves whenever a segment is written, created or deleted."""
        items = self.store.list_prefix(self.prefix(), keys_only=True).items
        return max((kv.mod_revision for kv in items), default=0), len(items)

    def get(self, collection: int, partition: int, segment: int) -> Decoded[SegmentInfo] | None:
        return self.store.get_model(self.store.keys.segment(collection, partition, segment), SegmentInfo)

    def swap(self, expected_version: int, new: SegmentInfo) -> Decoded[SegmentInfo]:
        """Write `new` if its key still has `expected_version` (0: absent), and return it as
        written; CasConflictError naming the key and both versions otherwise."""
        written = self.store.swap(self.key(new), expected_version, new)
        return Decoded(new, written)

    def _select(
        self,
        items: Sequence[KeyValue],
        vchannel: str | None,
        states: Collection[SegmentState] | None,
        skip_malformed: bool,
    ) -> builtins.list[Decoded[SegmentInfo]]:
        found = self.store.decode_models(items, SegmentInfo, skip_malformed)
        return [
            d
            for d in found
            if (vchannel is None or d.model.vchannel == vchannel)
            and (states is None or d.model.state in states)
        ]
