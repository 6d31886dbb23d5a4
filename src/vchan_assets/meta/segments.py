"""The one door to segment meta, `meta/segment/{collection}/{partition}/{segment}`.

Milvus' DataCoord reads and writes segments through its `meta.go` behind a catalog; here
every listing of segment meta goes through `SegmentMeta`, so paging, filters and the
policy for malformed values live in one place:

- listings are paged reads of etcd (`MetaStore.list_prefix`, Milvus' `WalkWithPrefix`):
  one snapshot at one revision however many segments a collection holds;
- a partition is ranged by its own prefix; a state filter is applied to the listing;
- a vchannel's segments are read through the per-vchannel index
  `meta/channel-segment/{vchannel}/{collection}/{partition}/{segment}`: its keys (read
  keys only) name the segment keys, which are then read at the index listing's revision
  (`MetaStore.get_at`), so a sync of one vchannel reads that vchannel's segments, not
  its collection's. An entry is put in the same transaction that creates its segment key
  and deleted in the one that deletes it (`create_puts`, `create`, `delete`: every site
  that creates or deletes a segment key goes through them; a segment's vchannel never
  changes). An entry whose segment is gone is skipped;
- a stack written before the index has segment keys without entries: until the mark
  `meta/channel-segment-index` exists, a vchannel's listing filters its collection's
  listing (correct, O(collection)). `backfill_channel_index` adds the missing entries and
  then writes the mark; the active DataCoord runs it at the start of its term (a
  no-op, one get, once the mark exists). It can be killed anywhere and run again;
- a value that does not decode raises `MalformedValueError` naming its key, unless the
  caller lists with `skip_malformed` (readers and schedulers that go on without it): the
  value is then logged and counted in `MetaStore.malformed_skipped`. Garbage collection,
  which deletes the files no listed segment names, lists strictly;
- `swap` is a compare-version-and-swap that returns the record as written, or raises
  `CasConflictError` naming the key, the version expected and the version found;
- a segment that becomes Dropped leaves the live family: in the transaction that drops it,
  its record moves to `meta/dropped/{collection}/{vchannel}/{partition}/{segment}` (a
  vchannel's dropped records are one range: a sync reads its own) and its live key and
  index entry are deleted, guarded on the live key's version (`swap`, and `writes` for a
  caller's own transaction). Milvus keeps dropped segments among the live ones until GC;
  here live listings (`list`, the per-vchannel index) read live segments only, and
  readers that need the dropped ones (GC, the catalog's table, reads at a past timestamp,
  a sync's insert floors, the DataCoord's summaries) ask `include_dropped`: both families
  are then read at one revision (or from one state of the segment cache, which follows
  both), so a segment being moved is seen exactly once. A dropped
  record is deleted by GC; the only write after the move is a sync's that wrote files for
  the segment before it learned of the drop (they go to GC with it);
- a Dropped segment written by a version before the dropped family still sits in the live
  family: live listings leave it out, `include_dropped` listings return it, and
  `move_dropped` (garbage collection, each pass) moves such records over in bounded
  transactions.
"""

from __future__ import annotations

import bisect
import builtins
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from vchan_assets.failpoints import failpoint
from vchan_assets.meta.codec import decode_dict
from vchan_assets.meta.errors import (
    CasConflictError,
    MalformedValueError,
    MetaError,
    RevisionCompactedError,
    TransactionTooLargeError,
)
from vchan_assets.meta.keys import KeyFamily
from vchan_assets.meta.store import (
    WALK_RESTARTS,
    ChannelGroup,
    Decoded,
    KeyValue,
    MetaStore,
    Snapshot,
    Value,
    too_many_ops,
)
from vchan_assets.model import SegmentInfo, SegmentState

log = logging.getLogger(__name__)

# `SegmentMeta._held_with`: the live segments, the Dropped ones, the keys under each prefix.
_HeldWith = tuple[
    builtins.list[Decoded[SegmentInfo]],
    builtins.list[Decoded[SegmentInfo]],
    builtins.list[builtins.list[KeyValue]],
]

# The version of the per-vchannel index the mark states; a mark of a lower version is
# backfilled again.
CHANNEL_INDEX_VERSION = 1
# What an index entry holds: nothing its key does not say (listings read keys only).
INDEX_ENTRY: dict[str, Any] = {}
# Entries a backfill transaction puts, each with a compare of its segment key (it must still
# exist): 60 puts and 61 compares with the writer's fence, under etcd's 128 operations a
# branch; fewer when an etcd with a lower --max-txn-ops refuses.
BACKFILL_BATCH = 60
# Dropped segments of the live family a migrating transaction moves: 4 operations each (a
# compare of its version; a put in the dropped family, 2 deletes), under etcd's 128.
MOVE_BATCH = 40


class SegmentMeta:
    """Segment meta in etcd, listed in pages and swapped by version."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store

    def key(self, segment: SegmentInfo) -> str:
        return self.store.keys.segment(segment.collection_id, segment.partition_id, segment.id)

    def dropped_key(self, segment: SegmentInfo) -> str:
        """Where the segment's record is once it is Dropped."""
        return self.store.keys.dropped_segment(
            segment.collection_id, segment.vchannel, segment.partition_id, segment.id
        )

    def is_dropped_key(self, key: str) -> bool:
        return key.startswith(self.store.keys.dropped_segment.prefix)

    def index_key(self, segment: SegmentInfo) -> str:
        """The segment's entry in its vchannel's index."""
        return self.store.keys.channel_segment(
            segment.vchannel, segment.collection_id, segment.partition_id, segment.id
        )

    # --- creating and deleting: the segment key and its index entry together -----------

    def create_puts(self, segment: SegmentInfo) -> dict[str, Value]:
        """The puts that create `segment` in a caller's transaction: its key and its
        vchannel's index entry (2 operations; the caller compares the key's version 0 where
        it may exist)."""
        return {self.key(segment): segment, self.index_key(segment): INDEX_ENTRY}

    def create_expect(self, segment: SegmentInfo) -> dict[str, int]:
        """The compares of a caller's transaction that creates `segment` where it may
        exist or have been dropped (a sync recreating a segment it finds no meta of): both
        its live key and its dropped record absent."""
        return {self.key(segment): 0, self.dropped_key(segment): 0}

    def create(self, segment: SegmentInfo) -> Decoded[SegmentInfo]:
        """`segment` created (its key must be absent, and it must never have been dropped)
        with its index entry, as written; CasConflictError naming the key that exists
        otherwise. A Dropped `segment` is created in the dropped family."""
        key, dropped = self.key(segment), self.dropped_key(segment)
        if segment.state is SegmentState.DROPPED:
            return Decoded(segment, self.store.swap(dropped, 0, segment, absent=[key]))
        puts = self.create_puts(segment)
        try:
            written = self.store.swap(key, 0, segment, {k: v for k, v in puts.items() if k != key}, [dropped])
        except CasConflictError as exc:
            found = self.store.get(dropped) if exc.found_version == 0 else None
            raise exc if found is None else CasConflictError(dropped, 0, found.version) from None
        return Decoded(segment, written)

    def writes(self, segment: SegmentInfo) -> tuple[dict[str, Value], builtins.list[str]]:
        """The puts and deletes that write `segment` over its live record in a caller's
        transaction (which compares the live key's version): a live one at its key (1
        operation); a Dropped one moved to the dropped family, its live key and index entry
        deleted (3 operations)."""
        if segment.state is not SegmentState.DROPPED:
            return {self.key(segment): segment}, []
        return {self.dropped_key(segment): segment}, [self.key(segment), self.index_key(segment)]

    def delete(self, found: Decoded[SegmentInfo]) -> None:
        """The segment's record deleted (a live one with its index entry) in one
        transaction, if its key is still at the version read; CasConflictError otherwise."""
        key = found.kv.key
        deletes = [key] if self.is_dropped_key(key) else [key, self.index_key(found.model)]
        if self.store.txn({key: found.kv.version}, {}, deletes) is None:
            now = self.store.get(key)
            raise CasConflictError(key, found.kv.version, now.version if now else 0)

    def prefix(self, collection: int | None = None, partition: int | None = None) -> str:
        """The range of a partition, a collection, or every segment (no collection)."""
        return _range(self.store.keys.segment, collection, partition)

    def dropped_prefix(self, collection: int | None = None, vchannel: str | None = None) -> str:
        """The range of the dropped records of a collection's vchannel, a collection, or all."""
        family = self.store.keys.dropped_segment
        if vchannel is not None:
            if collection is None:
                raise TypeError("a vchannel's dropped segments are listed with its collection")
            return family.under(collection, vchannel)
        return family.prefix if collection is None else family.under(collection)

    def list(
        self,
        collection: int | None = None,
        *,
        vchannel: str | None = None,
        partition: int | None = None,
        states: Collection[SegmentState] | None = None,
        skip_malformed: bool = False,
        include_dropped: bool = False,
    ) -> list[Decoded[SegmentInfo]]:
        """The live segments of a collection (every collection's without one), with their
        etcd versions, in key order, at one revision; only those of `vchannel`, `partition`
        and `states` when given. From the process's segment cache when it has one (as
        fresh as etcd, see meta/segment_cache.py); else with a `vchannel`, read through
        its index (its segments only) once the index is complete, else filtered from the
        collection's listing. `include_dropped`: the Dropped ones too, read from the
        dropped family at the revision of the live listing (a segment being moved is
        listed once), in the order of their live keys."""
        if not include_dropped:
            return self._live_models(collection, vchannel, partition, states, skip_malformed)
        prefix = self.dropped_prefix(collection, vchannel if collection is not None else None)
        cache = self.store.segment_cache
        both = (
            None
            if cache is None
            else cache.decoded_many([self.prefix(collection, partition), prefix], skip_malformed)
        )
        if both is not None:  # both families from one state of the copy
            held, gone = both
            if partition is not None:
                gone = [d for d in gone if d.model.partition_id == partition]
            return self._merged(self._filter(held, vchannel, states), self._filter(gone, vchannel, states))
        live = self._live(collection, vchannel, partition)
        try:
            dropped = self.store.list_prefix(prefix, revision=live.revision).items
        except RevisionCompactedError:  # compacted since the live listing: both again, at once
            live_items, dropped = self.store.list_prefixes([self.prefix(collection, partition), prefix])
            live = Snapshot(live_items, 0)
        gone = self.store.decode_models(dropped, SegmentInfo, skip_malformed)
        if partition is not None:
            gone = [d for d in gone if d.model.partition_id == partition]
        return self._merged(
            self._select(live.items, vchannel, states, skip_malformed), self._filter(gone, vchannel, states)
        )

    def _merged(
        self, live: builtins.list[Decoded[SegmentInfo]], gone: builtins.list[Decoded[SegmentInfo]]
    ) -> builtins.list[Decoded[SegmentInfo]]:
        """`live` (in key order) with the dropped records `gone` put in the order of their
        live keys: a bisection each, not a sort of the whole listing (at 100,000 live
        segments a sort by live key cost the DataCoord's reload 0.1 s of its step)."""
        if not gone:
            return live
        keyed = sorted(((self._live_key_of(d.kv.key), d) for d in gone), key=lambda pair: pair[0])
        keys = [d.kv.key for d in live]
        merged: builtins.list[Decoded[SegmentInfo]] = []
        done = 0
        for key, d in keyed:
            at = bisect.bisect_left(keys, key, done)
            merged += live[done:at]
            merged.append(d)
            done = at
        merged += live[done:]
        return merged

    def _live_models(
        self,
        collection: int | None,
        vchannel: str | None,
        partition: int | None,
        states: Collection[SegmentState] | None,
        skip_malformed: bool,
    ) -> builtins.list[Decoded[SegmentInfo]]:
        """The segments of the live family, decoded (by the segment cache where the process
        has one: a prefix listed again while nothing changed is not decoded again), without
        the Dropped records an older version left there."""
        cache = self.store.segment_cache
        prefix = self.prefix(collection, partition)
        decoded = None if cache is None else cache.decoded(prefix, skip_malformed, live_only=True)
        if decoded is not None:
            return self._filter(decoded, vchannel, states)
        found = self._select(
            self._live(collection, vchannel, partition).items, vchannel, states, skip_malformed
        )
        return [d for d in found if d.model.state is not SegmentState.DROPPED]

    def _live(self, collection: int | None, vchannel: str | None, partition: int | None) -> Snapshot:
        """The keys of the live family (from the segment cache where the process has one)."""
        cached = self._cached(self.prefix(collection, partition))
        if cached is not None:
            return cached
        if vchannel is not None and self.channel_index_ready():
            return self._channel_items(vchannel, collection, partition)
        return self.store.list_prefix(self.prefix(collection, partition))

    def dropped_of(self, key: str) -> Decoded[SegmentInfo] | None:
        """The dropped record of the segment whose live key is `key`, or None."""
        collection, partition, segment = key[len(self.store.keys.segment.prefix) :].split("/")
        return self.get(int(collection), int(partition), int(segment), include_dropped=True)

    def _live_key_of(self, key: str) -> str:
        """The live key of a segment key of either family (a dropped key names its vchannel
        between the collection and the partition)."""
        dropped = self.store.keys.dropped_segment.prefix
        if not key.startswith(dropped):
            return key
        collection, _vchannel, partition, segment = key[len(dropped) :].split("/")
        return self.store.keys.segment(collection, partition, segment)

    def _cached(self, prefix: str) -> Snapshot | None:
        """The keys under `prefix` from the process's segment cache, None without one or
        when it cannot prove it is current (then etcd is read)."""
        cache = self.store.segment_cache
        return None if cache is None else cache.snapshot(prefix)

    def _channel_items(self, vchannel: str, collection: int | None, partition: int | None) -> Snapshot:
        """The segment keys a vchannel's index names, read at the revision of the index's
        listing (again at a fresh one if etcd compacted it meanwhile, as a paged walk)."""
        ids = [i for i in (collection, partition) if i is not None]
        if partition is not None and collection is None:
            raise TypeError("a partition's segments are listed with its collection")
        prefix = self.store.keys.channel_segment.under(vchannel, *ids)
        for restart in range(WALK_RESTARTS + 1):
            entries = self.store.list_prefix(prefix, keys_only=True)
            keys = [self._segment_key_of(kv.key) for kv in entries.items]
            try:
                found = self.store.get_at(keys, entries.revision)
            except RevisionCompactedError as exc:
                if restart == WALK_RESTARTS:
                    raise
                log.warning("%s: listing %s again at a fresh revision", exc, prefix)
                continue
            return Snapshot([kv for kv in found if kv is not None], entries.revision)
        raise AssertionError("unreachable: the last restart raises")

    def _segment_key_of(self, entry: str) -> str:
        collection, partition, segment = entry.rsplit("/", 3)[1:]
        return self.store.keys.segment(collection, partition, segment)

    def list_with(
        self,
        collection: int,
        prefixes: Sequence[str],
        skip_malformed: bool = False,
        partitions: tuple[Sequence[int], Sequence[str]] | None = None,
        exact: Sequence[str] = (),
    ) -> tuple[builtins.list[Decoded[SegmentInfo]], builtins.list[builtins.list[KeyValue]]]:
        """The collection's segments, the Dropped ones included (a read at a past timestamp
        serves a segment dropped after it), and the keys under each of `prefixes`, then each
        of the `exact` keys (a list of its value or none), all read at one revision (a
        read's segments, the indexes of those very segments, its channel checkpoints).
        `partitions`: (partition ids, the collection's vchannels): only those partitions'
        segments, read by their own ranges (a partition's live range, and its range in each
        vchannel's dropped records), not the collection's."""
        if partitions is None:
            ranges = [[self.prefix(collection)], [self.dropped_prefix(collection)]]
        else:
            ids, vchannels = partitions
            family = self.store.keys.dropped_segment
            ranges = [
                [self.prefix(collection, p) for p in ids],
                [family.under(collection, v, p) for v in vchannels for p in ids],
            ]
        held = self._held_with(ranges, prefixes, skip_malformed, exact)
        if held is not None:
            live, gone, others = held
        else:
            listed = self.store.list_prefixes([*ranges[0], *ranges[1], *prefixes], exact=exact)
            split = len(ranges[0]) + len(ranges[1])
            live_kvs = [kv for items in listed[: len(ranges[0])] for kv in items]
            dropped = [kv for items in listed[len(ranges[0]) : split] for kv in items]
            others = listed[split:]
            gone = self.store.decode_models(dropped, SegmentInfo, skip_malformed)  # (not the cache's)
            live = self._select(live_kvs, None, None, skip_malformed)
        if not gone and len(ranges[0]) == 1:
            return live, others  # (one range, in key order already)
        return sorted([*live, *gone], key=lambda d: self._live_key_of(d.kv.key)), others

    def _held_with(
        self,
        ranges: Sequence[Sequence[str]],
        prefixes: Sequence[str],
        skip_malformed: bool,
        exact: Sequence[str] = (),
    ) -> _HeldWith | None:
        """`list_with` from the process's segment cache: the segments of the live `ranges[0]`
        and the dropped `ranges[1]` as the copy holds them, and the keys under `prefixes`
        read from etcd at the revision that copy stands at (one snapshot). None without a
        cache, when it cannot prove it is current, or when etcd compacted that revision
        since (the caller reads etcd)."""
        cache = self.store.segment_cache
        held = None if cache is None else cache.decoded_at([*ranges[0], *ranges[1]], skip_malformed)
        if held is None:
            return None
        parts, revision = held
        others = self._others_at(revision, prefixes, exact)
        if others is None:
            return None
        live, gone = parts[: len(ranges[0])], parts[len(ranges[0]) :]
        return [d for part in live for d in part], [d for part in gone for d in part], others

    def held_channels(
        self,
        collection: int,
        prefixes: Sequence[str],
        skip_malformed: bool = False,
        exact: Sequence[str] = (),
    ) -> tuple[dict[str, ChannelGroup], builtins.list[builtins.list[KeyValue]]] | None:
        """`list_with` by vchannel, from the process's segment cache: the collection's
        records (both families) in groups by vchannel, each with the generation a reader
        keeps what it derives from them by (`SegmentCache.channel_groups`), and the keys
        under `prefixes`, then each of the `exact` keys, read from etcd at the revision
        that copy stands at. None without a cache, when it cannot prove it is current, or
        when etcd compacted that revision since: the caller uses `list_with`."""
        cache = self.store.segment_cache
        ranges = [self.prefix(collection), self.dropped_prefix(collection)]
        held = None if cache is None else cache.channel_groups(collection, ranges, skip_malformed)
        if held is None:
            return None
        groups, revision = held
        others = self._others_at(revision, prefixes, exact)
        return None if others is None else (groups, others)

    def _others_at(
        self, revision: int, prefixes: Sequence[str], exact: Sequence[str]
    ) -> builtins.list[builtins.list[KeyValue]] | None:
        """The keys under `prefixes`, then each of the `exact` keys, read at the revision a
        held copy stands at; None when etcd compacted it since (the caller reads etcd)."""
        try:
            return self.store.list_prefixes(prefixes, revision=revision, exact=exact)
        except RevisionCompactedError:
            return None

    def segment_keys(self) -> Snapshot:
        """Every segment key (keys only, paged at one revision; from the segment cache,
        with their values, where the process has one)."""
        cached = self._cached(self.prefix())
        return cached if cached is not None else self.store.list_prefix(self.prefix(), keys_only=True)

    def changes_seen(self, listing: Snapshot | None = None) -> tuple[int, int]:
        """(the highest mod revision, the count) of every segment key (of `listing`, read
        by `segment_keys`, if given): it moves whenever a segment is written, created or
        deleted."""
        items = (listing or self.segment_keys()).items
        return max((kv.mod_revision for kv in items), default=0), len(items)

    def dropped_changes_seen(self) -> tuple[int, int]:
        """`changes_seen` of the dropped family: from the segment cache where the process
        has one, else from one request whatever the family's size (etcd still reads every
        value of the range to sort it: 0.25 s at 100,000 keys)."""
        cache = self.store.segment_cache
        held = None if cache is None else cache.snapshot(self.dropped_prefix())
        if held is not None:
            return self.changes_seen(held)
        return self.store.newest_and_count(self.dropped_prefix())

    def get(
        self,
        collection: int,
        partition: int,
        segment: int,
        include_dropped: bool = False,
        vchannel: str | None = None,
    ) -> Decoded[SegmentInfo] | None:
        """The segment's live record (a Dropped one left in the live family by an older
        version counts as dropped); with `include_dropped`, its dropped record when it has
        no live one: one read with its `vchannel`, else found among the keys of the
        collection's dropped records (keys only)."""
        found = self.store.get_model(self.store.keys.segment(collection, partition, segment), SegmentInfo)
        if found is not None and (include_dropped or found.model.state is not SegmentState.DROPPED):
            return found
        if not include_dropped:
            return None
        family = self.store.keys.dropped_segment
        if vchannel is not None:
            return self.store.get_model(family(collection, vchannel, partition, segment), SegmentInfo)
        tail = f"/{partition}/{segment}"
        keys = self.store.list_prefix(family.under(collection), keys_only=True).items
        key = next((kv.key for kv in keys if kv.key.endswith(tail)), None)
        return None if key is None else self.store.get_model(key, SegmentInfo)

    def swap(self, expected_version: int, new: SegmentInfo) -> Decoded[SegmentInfo]:
        """Write `new` if its live key still has `expected_version` (0: absent, then
        created with its index entry), and return it as written; CasConflictError naming
        the key and both versions otherwise. A Dropped `new` is moved to the dropped family
        in the same transaction (its live key and index entry deleted)."""
        if expected_version == 0:
            return self.create(new)
        if new.state is SegmentState.DROPPED:
            written = self.store.move(
                self.key(new), expected_version, self.dropped_key(new), new, [self.index_key(new)]
            )
            return Decoded(new, written)
        written = self.store.swap(self.key(new), expected_version, new)
        return Decoded(new, written)

    # --- Dropped segments an older version left in the live family ----------------------

    def move_dropped(self, found: Sequence[Decoded[SegmentInfo]]) -> int:
        """The Dropped records of `found` (a listing) still in the live family moved to the
        dropped family, MOVE_BATCH a transaction (fewer when etcd refuses a batch as too
        large), each guarded on the version listed; returns how many were moved. A record
        changed or gone since the listing is left for the next pass. Killed anywhere, it is
        run again: what was moved is not in the live family any more."""
        rest = [
            d for d in found if d.model.state is SegmentState.DROPPED and not self.is_dropped_key(d.kv.key)
        ]
        moved, size = 0, MOVE_BATCH
        while rest:
            batch = rest[:size]
            puts: dict[str, Value] = {}
            deletes: builtins.list[str] = []
            for d in batch:
                puts[self.dropped_key(d.model)] = d.model
                deletes += [d.kv.key, self.index_key(d.model)]
            try:
                done = self.store.txn({d.kv.key: d.kv.version for d in batch}, puts, deletes)
            except MetaError as exc:
                if not (too_many_ops(exc) or isinstance(exc, TransactionTooLargeError)) or size == 1:
                    raise
                size = max(1, size // 2)
                continue
            if done is None:  # one changed meanwhile: the batch one by one, the changed left
                moved += sum(self._move_one(d) for d in batch)
            else:
                moved += len(batch)
            rest = rest[len(batch) :]
            failpoint("move_dropped")
        if moved:
            log.info("moved %d Dropped segments an older version left in %s", moved, self.prefix())
        return moved

    def _move_one(self, d: Decoded[SegmentInfo]) -> bool:
        try:
            self.store.move(
                d.kv.key, d.kv.version, self.dropped_key(d.model), d.model, [self.index_key(d.model)]
            )
        except CasConflictError:
            return False
        return True

    # --- the per-vchannel index: its mark and its backfill ------------------------------

    def channel_index_ready(self) -> bool:
        """Whether every segment key has its index entry (the backfill's mark is there)."""
        found = self.store.get(self.store.keys.channel_segment_index())
        if found is None:
            return False
        try:
            return int(decode_dict(found.key, found.value).get("version", 0)) >= CHANNEL_INDEX_VERSION
        except (MalformedValueError, TypeError, ValueError):
            log.error("the mark %s does not decode: listing vchannels by their collections", found.key)
            return False

    def backfill_channel_index(self) -> int:
        """Make the index complete on a stack written before it, then write the mark;
        returns how many entries were added (0 at once when the mark is there).

        Killed anywhere, it is run again: the entries already written are not written
        again (`repair_channel_index` adds only what is missing), and the mark comes last."""
        if self.channel_index_ready():
            return 0
        added, removed = self.repair_channel_index()
        self.store.put(
            self.store.keys.channel_segment_index(),
            {"version": CHANNEL_INDEX_VERSION, "at": time.time(), "added": added, "removed": removed},
        )
        log.info("the per-vchannel segment index is complete: %d entries added, %d removed", added, removed)
        return added

    def repair_channel_index(self, listing: Snapshot | None = None) -> tuple[int, int]:
        """(entries added, entries removed): an entry for each segment key that lacks one
        and none for a segment key that is gone, from the keys of both read at one revision
        (keys only; the values of the segments that lack an entry are then read in batches,
        for their vchannels). New code writes both in one transaction; a difference is a
        stack written before the index, or a process of that version still running during
        a rolling upgrade (the DataCoord's meta reload repairs it, see `MetaReloader`).

        Each transaction puts a batch of entries only if their segment keys still exist and
        deletes entries only if their segment keys are still absent, so a segment deleted
        or created meanwhile is never mis-indexed. A segment value that does not decode
        cannot be indexed (its vchannel is unknown): it is logged and counted, as listings
        that skip it. `listing`: the segment keys as `segment_keys` read them (the
        DataCoord's reload has them already); the index's keys are then read at its
        revision."""
        segments, entries = self._keys_and_entries(listing)
        indexed = {self._segment_key_of(kv.key): kv.key for kv in entries}
        present = {kv.key for kv in segments}
        missing = [kv.key for kv in segments if kv.key not in indexed]
        stale = [(segment, entry) for segment, entry in indexed.items() if segment not in present]
        added = 0
        for i in range(0, len(missing), BACKFILL_BATCH):
            found = self.store.get_at(missing[i : i + BACKFILL_BATCH], self.store.revision())
            values = [kv for kv in found if kv is not None]
            added += self._index_batches(self.store.decode_models(values, SegmentInfo, skip_malformed=True))
        removed = self._unindex(stale)
        return _repaired(added, removed)

    def repair_channel_index_of(
        self,
        listing: Snapshot,
        entries: Mapping[str, str],
        created: Collection[str],
        deleted: Collection[str],
    ) -> tuple[int, int]:
        """`repair_channel_index` for the segment keys `created` and `deleted` since an
        earlier listing only (the DataCoord's reload, from its segment cache: O(changes)
        instead of every key of both families). `listing` holds the values of `created`;
        `entries`: the index entry of each segment key of the earlier listing. The entries
        of both are read at the listing's revision."""
        made = {kv.key: kv for kv in listing.items if kv.key in created}
        decoded = self._models(list(made.values()), skip_malformed=True)
        want = {d.kv.key: self.index_key(d.model) for d in decoded}
        gone = {key: entries[key] for key in deleted if key in entries}
        check = [*want.values(), *gone.values()]
        found: dict[str, bool] = {}
        for i in range(0, len(check), BACKFILL_BATCH):
            batch = check[i : i + BACKFILL_BATCH]
            found.update(
                zip(batch, (kv is not None for kv in self.store.get_at(batch, listing.revision)), strict=True)
            )
        added = self._index_batches([d for d in decoded if not found[want[d.kv.key]]])
        removed = self._unindex([(segment, entry) for segment, entry in gone.items() if found[entry]])
        return _repaired(added, removed)

    def index_entries(self, items: Sequence[KeyValue]) -> dict[str, str]:
        """The index entry each segment of `items` (with values) has, by segment key."""
        return {d.kv.key: self.index_key(d.model) for d in self._models(items, skip_malformed=True)}

    def _keys_and_entries(
        self, listing: Snapshot | None
    ) -> tuple[builtins.list[KeyValue], builtins.list[KeyValue]]:
        """Every segment key and every index entry, keys only, at one revision."""
        entries_prefix = self.store.keys.channel_segment.prefix
        if listing is not None:
            try:
                entries = self.store.list_prefix(entries_prefix, revision=listing.revision, keys_only=True)
                return listing.items, entries.items
            except RevisionCompactedError:
                pass  # compacted since the listing: both again, at a fresh revision
        segments, entries_now = self.store.list_prefixes([self.prefix(), entries_prefix], keys_only=True)
        return segments, entries_now

    def _index_batches(self, missing: Sequence[Decoded[SegmentInfo]]) -> int:
        """Entries for `missing`, in transactions of at most BACKFILL_BATCH, each only if its
        segment keys exist; returns how many were written."""
        written, size = 0, BACKFILL_BATCH
        rest = list(missing)
        while rest:
            batch = rest[:size]
            puts: dict[str, Value] = {self.index_key(d.model): INDEX_ENTRY for d in batch}
            try:
                done = self.store.txn({}, puts, present=[d.kv.key for d in batch])
            except MetaError as exc:
                if not too_many_ops(exc) or size == 1:
                    raise
                size = max(1, size // 2)
                continue
            if done is None:  # a segment of the batch was deleted meanwhile: leave it out
                rest = [d for d in rest if d not in batch or self.store.get(d.kv.key) is not None]
                continue
            written += len(batch)
            rest = rest[len(batch) :]
            failpoint("channel_index_backfill")
        return written

    def _unindex(self, stale: Sequence[tuple[str, str]]) -> int:
        """The entries of `stale` (segment key, entry key) deleted, each only while its
        segment key is absent; returns how many were."""
        removed = 0
        for segment, entry in stale:
            if self.store.txn({segment: 0}, {}, [entry]) is not None:
                removed += 1
        return removed

    def _models(self, items: Sequence[KeyValue], skip_malformed: bool) -> builtins.list[Decoded[SegmentInfo]]:
        cache = self.store.segment_cache
        if cache is not None:
            return cache.models(items, skip_malformed)  # each version decoded once
        return self.store.decode_models(items, SegmentInfo, skip_malformed)

    def _select(
        self,
        items: Sequence[KeyValue],
        vchannel: str | None,
        states: Collection[SegmentState] | None,
        skip_malformed: bool,
    ) -> builtins.list[Decoded[SegmentInfo]]:
        return self._filter(self._models(items, skip_malformed), vchannel, states)

    @staticmethod
    def _filter(
        found: Sequence[Decoded[SegmentInfo]], vchannel: str | None, states: Collection[SegmentState] | None
    ) -> builtins.list[Decoded[SegmentInfo]]:
        if vchannel is None and states is None:
            return builtins.list(found)
        return [
            d
            for d in found
            if (vchannel is None or d.model.vchannel == vchannel)
            and (states is None or d.model.state in states)
        ]


def _range(family: KeyFamily, collection: int | None, partition: int | None) -> str:
    if partition is not None:
        if collection is None:
            raise TypeError("a partition's segments are listed with its collection")
        return family.under(collection, partition)
    return family.prefix if collection is None else family.under(collection)


def _repaired(added: int, removed: int) -> tuple[int, int]:
    """A repair's (added, removed), logged when it changed the index."""
    if added or removed:
        log.warning(
            "the per-vchannel segment index lacked %d entries and held %d of segments gone", added, removed
        )
    return added, removed
