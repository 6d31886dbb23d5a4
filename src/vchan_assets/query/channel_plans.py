"""Which segments a read at T sees of each vchannel, and the plans of it a process keeps.

`segments_at` puts a collection's segment meta back as it stood at T as far as compactions
go (`query.asof` says why). `channel_views` is what a read plans from segment meta held in
memory (`meta.segment_cache.SegmentCache`): the segments at T and the query view of each
vchannel, kept between reads as long as they hold, as Milvus' QueryCoord keeps a channel's
segment distribution and changes it only when that channel's segments change. A search of
a collection of 100,000 segments whose vchannels did not change since the last one then
plans in about the time a search of 1,000 does, instead of going over every segment again.

A vchannel's plan made at T serves a read at T' when:

- the vchannel's segment records are the ones it was made from (the cache's group
  generation: any put or delete of one of them makes a new one);
- the collection's live indexes (`index_ready`) and the vchannel's start position are the
  ones it was made with;
- T' is T, or both are at or past every stamp that makes a segment's place depend on the
  read's time (its `dropped_ts` and `dropped_at`: a segment dropped after the read is live
  in it; its `ready_ts`: a mix output replaces its inputs from then). Past every stamp,
  reads at any two times see the same segments, so a plan made at "now" serves every later
  "now" until the vchannel changes.

The view is kept without its checkpoint, which moves without any segment changing; each
read sets the checkpoint it read (and the seek position follows it).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import overload

from vchan_assets.datacoord.recovery import start_position
from vchan_assets.meta.store import ChannelGroup
from vchan_assets.model import (
    CollectionInfo,
    FieldIndex,
    MsgPosition,
    SegmentInfo,
    SegmentState,
    physical_ms,
    replaces_inputs_at,
)
from vchan_assets.query.view import QueryView, query_view


def segments_at(segments: Iterable[SegmentInfo], ts: int) -> list[SegmentInfo]:
    """The segment meta as it stood at `ts` as far as compactions go: a segment a
    compaction dropped after `ts` is live again (Flushed, as it was), and the outputs of
    that compaction are left out. Other segments stay as they are: their rows are filtered
    by timestamp."""
    by_id = {s.id: s for s in segments}

    def committed_after(seg: SegmentInfo) -> bool:
        return any(dropped_after(p, ts) for i in seg.compaction_from if (p := by_id.get(i)))

    out = []
    for seg in by_id.values():
        if seg.compaction_from and committed_after(seg):
            continue  # made after `ts`
        if seg.state is SegmentState.DROPPED and dropped_after(seg, ts):
            seg = replace(seg, state=SegmentState.FLUSHED, dropped_at=None, dropped_ts=0)
        out.append(seg)
    return out


def dropped_after(seg: SegmentInfo, ts: int) -> bool:
    """The segment was dropped after `ts`: by the timestamp its compaction stamped (the
    newest delete its outputs applied), else by the wall clock of the drop."""
    if seg.dropped_ts:
        return seg.dropped_ts > ts
    return seg.dropped_at is not None and seg.dropped_at > physical_ms(ts) / 1000


@dataclass(frozen=True)
class _Stamps:
    """The newest of a vchannel's stamps that a read's time is compared with."""

    ts: int  # the newest dropped_ts or ready_ts
    dropped_at: float  # the newest dropped_at (wall-clock seconds)

    @classmethod
    def of(cls, segments: Sequence[SegmentInfo]) -> _Stamps:
        return cls(
            max((max(s.dropped_ts, s.ready_ts) for s in segments), default=0),
            max((s.dropped_at for s in segments if s.dropped_at is not None), default=0.0),
        )

    def passed_by(self, ts: int) -> bool:
        """A read at `ts` comes after every stamp: no segment's place depends on `ts`."""
        return ts >= self.ts and physical_ms(ts) / 1000 >= self.dropped_at


@dataclass(frozen=True)
class ChannelPlan:
    """A vchannel's segments at `ts` (key order) and its query view without a checkpoint."""

    generation: int  # of the vchannel's group of records it was made from
    ts: int
    stamps: _Stamps  # once `ts` is past them all, the plan serves any later time past them
    indexes: tuple[FieldIndex, ...]
    start: MsgPosition
    segments: list[SegmentInfo]
    view: QueryView

    @classmethod
    def make(
        cls,
        group: ChannelGroup | None,
        vchannel: str,
        ts: int,
        indexes: tuple[FieldIndex, ...],
        start: MsgPosition,
    ) -> ChannelPlan:
        records = {} if group is None else group.records
        segments = segments_at((records[k].model for k in sorted(records)), ts)
        stamps = _Stamps.of([records[k].model for k in records])
        view = query_view(segments, vchannel, None, start, lambda seg: replaces_inputs_at(seg, indexes, ts))
        generation = 0 if group is None else group.generation
        return cls(generation, ts, stamps, indexes, start, segments, view)

    def serves(self, generation: int, ts: int, indexes: tuple[FieldIndex, ...], start: MsgPosition) -> bool:
        if generation != self.generation or indexes != self.indexes or start != self.start:
            return False
        return ts == self.ts or (self.stamps.passed_by(self.ts) and self.stamps.passed_by(ts))

    def view_with(self, checkpoint: MsgPosition | None) -> QueryView:
        """The view with the vchannel's checkpoint: replay starts there."""
        if checkpoint is None:
            return self.view
        return replace(self.view, checkpoint=checkpoint, seek_position=checkpoint)


class HeldPlans:
    """The channel plans one segment cache's reads keep (`held_plans`); `made` and `reused`
    count them."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, str], ChannelPlan] = {}
        self._lock = threading.Lock()
        self.made = 0
        self.reused = 0

    def plan(
        self,
        info: CollectionInfo,
        vchannel: str,
        group: ChannelGroup | None,
        ts: int,
        indexes: tuple[FieldIndex, ...],
    ) -> ChannelPlan:
        start = start_position(info, vchannel)
        generation = 0 if group is None else group.generation
        with self._lock:
            found = self._plans.get((info.id, vchannel))
            if found is not None and found.serves(generation, ts, indexes, start):
                self.reused += 1
                return found
        made = ChannelPlan.make(group, vchannel, ts, indexes, start)
        with self._lock:
            self._plans[(info.id, vchannel)] = made
            self.made += 1
        return made

    def clear(self) -> None:
        """Forget every plan (the next read of each vchannel makes it again)."""
        with self._lock:
            self._plans.clear()

    def forget_others(self, collection: int, vchannels: Iterable[str]) -> None:
        """Drop the plans of the collection's vchannels other than `vchannels`."""
        keep = set(vchannels)
        with self._lock:
            for key in [k for k in self._plans if k[0] == collection and k[1] not in keep]:
                del self._plans[key]


_HELD: weakref.WeakKeyDictionary[object, HeldPlans] = weakref.WeakKeyDictionary()
_HELD_LOCK = threading.Lock()


def held_plans(cache: object) -> HeldPlans:
    """The plans kept for reads through `cache` (a segment cache), made at the first."""
    with _HELD_LOCK:
        found = _HELD.get(cache)
        if found is None:
            found = _HELD[cache] = HeldPlans()
        return found


class ChannelSegments(Sequence[SegmentInfo]):
    """The segments of several vchannels, a list each, read as one sequence without being
    copied into one (a read of 100,000 segments whose plans are kept does not copy them)."""

    __slots__ = ("_parts", "_len")

    def __init__(self, parts: Iterable[Sequence[SegmentInfo]]) -> None:
        self._parts = tuple(parts)
        self._len = sum(len(p) for p in self._parts)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[SegmentInfo]:
        return itertools.chain.from_iterable(self._parts)

    @overload
    def __getitem__(self, index: int) -> SegmentInfo: ...
    @overload
    def __getitem__(self, index: slice) -> list[SegmentInfo]: ...
    def __getitem__(self, index: int | slice) -> SegmentInfo | list[SegmentInfo]:
        if isinstance(index, slice):
            return list(self)[index]
        at = index + self._len if index < 0 else index
        if not 0 <= at < self._len:
            raise IndexError(index)
        for part in self._parts:
            if at < len(part):
                return part[at]
            at -= len(part)
        raise AssertionError("unreachable: the index is within the length")

    def __repr__(self) -> str:
        return f"ChannelSegments({list(self)!r})"


def channel_order(info: CollectionInfo, present: Iterable[str]) -> list[str]:
    """The collection's vchannels, then any other that its segments name (sorted)."""
    return [*info.vchannels, *sorted(set(present) - set(info.vchannels))]


def channel_views(
    plans: HeldPlans,
    info: CollectionInfo,
    groups: Mapping[str, ChannelGroup],
    checkpoints: Mapping[str, MsgPosition | None],
    ts: int,
    indexes: Sequence[FieldIndex],
) -> tuple[ChannelSegments, list[QueryView]]:
    """The collection's segments at `ts` (by vchannel, each in key order) and the query
    view of each vchannel, from its groups of records (`SegmentCache.channel_groups`) and
    the checkpoints read at their revision: each vchannel's plan kept from an earlier read
    where it serves this one, else made and kept."""
    kept = tuple(indexes)
    order = channel_order(info, groups)
    made = [plans.plan(info, vchannel, groups.get(vchannel), ts, kept) for vchannel in order]
    plans.forget_others(info.id, order)
    views = [plan.view_with(checkpoints.get(plan.view.vchannel)) for plan in made]
    return ChannelSegments(plan.segments for plan in made), views
