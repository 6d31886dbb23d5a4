"""The query view of a vchannel: what a reader may see of it, and where to start replay.

Every reader selects segments through this one view (the catalog's `read_collection`,
the Spark source, and later search), so a rule written here holds for all of them. It is
Milvus' `GetQueryVChanPositions` (DataCoord's handler) in this project's terms.

The view is computed from the vchannel's segment meta (segments of other vchannels, and
segments still Importing, are left out: an import's segments appear when its job commits):

- **dropped**: Dropped segments (their rows live on in the segments compacted from them),
  unless the lineage below serves one again.
- **l0**: live L0 segments, in any state: their delta logs hold deletes, no rows.
- **growing**: L1/L2 segments not Flushed yet (Growing, Sealed, Flushing), and Flushed
  segments that are still invisible (written by the flush, not yet sorted): a reader
  reads their binlogs like any other, but they count as growing.
- **flushed**: the other Flushed L1/L2 segments, once lineage is resolved.

Compaction lineage. A compaction output names its inputs in `compaction_from`; the commit
adds the outputs and drops the inputs. An output replaces its inputs only once it can be
served; until then the inputs are served in its place, found through `compaction_from`
recursively, even when they are Dropped (their files stay until garbage collection):

- an invisible compaction output is never served; its inputs are;
- an output whose inputs are still served as flushed (the commit has not dropped them)
  is not served: serving both would return their rows twice;
- a sort output replaces an invisible input at once (sorting is what makes it visible);
- a mix output replaces its visible inputs once it is indexed (`ready`; Milvus' rule, so
  that a search never loses the inputs' indexes): at once when it awaits no index
  (`model.awaited_indexes`: none of its collection's live indexes, created before it,
  gets files for its rows), else from its `ready_ts`, stamped by the commit of its last
  awaited build, or when the wait is given up (a build Failed for good, or
  VCHAN_INDEX_HANDOFF_TIMEOUT). A read at T serves it only if `ready_ts` <= T: a read
  in the past picks the segments it picked then;
- an output whose inputs are gone from meta (collected) is served: nothing else holds
  its rows.

Seek position: where replay of the vchannel's log starts for a reader that holds the
view's segments. The channel checkpoint, else the earliest position of a live segment
(its dml position, else its start position), else the collection's start position on the
vchannel.

Unlike Milvus, a segment without any log position is kept: bulk-imported segments carry
none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from vchan_assets.datacoord.recovery import start_position
from vchan_assets.indexes.meta import list_indexes
from vchan_assets.meta.codec import decode
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import KeyValue, MetaStore
from vchan_assets.model import (
    CollectionInfo,
    FieldIndex,
    MsgPosition,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    replaces_inputs_at,
)

# Whether a mix compaction output may replace its visible inputs (`index_ready`).
Ready = Callable[[SegmentInfo], bool]


def _ids_of(kind: str) -> cached_property[frozenset[int]]:
    """The ids of a view's segments of one class (`QueryView.flushed` ...), made once."""
    return cached_property(lambda view: frozenset(s.id for s in getattr(view, kind)))


@dataclass(frozen=True)
class QueryView:
    """What a reader may see of one vchannel: its segments by class (each sorted by id)
    and the position replay starts from."""

    vchannel: str
    seek_position: MsgPosition
    checkpoint: MsgPosition | None = None  # everything at or below it is in segments
    flushed: tuple[SegmentInfo, ...] = ()
    growing: tuple[SegmentInfo, ...] = ()
    l0: tuple[SegmentInfo, ...] = ()
    dropped: tuple[SegmentInfo, ...] = ()

    # The ids of each class, for membership tests (made at the first use: a view kept
    # between reads is copied with each read's checkpoint, `query.channel_plans`).
    flushed_ids = _ids_of("flushed")
    growing_ids = _ids_of("growing")
    l0_ids = _ids_of("l0")
    dropped_ids = _ids_of("dropped")

    @property
    def readable(self) -> tuple[SegmentInfo, ...]:
        """The segments whose rows a reader returns: flushed and growing ones that have
        binlogs (one synced, not yet flushed, has some; one just allocated has none)."""
        return tuple(s for s in (*self.flushed, *self.growing) if s.binlogs)

    def delta_paths(self, partition_id: int) -> list[str]:
        """The delta logs of the partition's served segments: those of the L0 segments,
        and those that L0 compaction moved into the segments holding their pks."""
        return [
            b.path
            for seg in (*self.l0, *self.flushed, *self.growing)
            if seg.partition_id == partition_id
            for b in seg.deltalogs
        ]


def always(_: SegmentInfo) -> bool:
    return True


def index_ready(
    store: MetaStore, collection_id: int, ts: int | None = None, indexes: Sequence[FieldIndex] | None = None
) -> Ready:
    """Whether a mix compaction output of the collection replaces its visible inputs in a
    read at `ts` (None: now): it awaits no index, or was stamped ready by then
    (`model.replaces_inputs_at`). `indexes`: the collection's live indexes, when the caller
    listed them with (or after) its segments; else they are listed here, once."""
    if indexes is None:
        indexes = [d.model for d in list_indexes(store, collection_id)]
    return lambda seg: replaces_inputs_at(seg, indexes, ts)


def query_view(
    segments: Iterable[SegmentInfo],
    vchannel: str,
    checkpoint: MsgPosition | None,
    start_position: MsgPosition,
    ready: Ready = always,
) -> QueryView:
    """The query view of `vchannel` from its segment meta (`segments` may hold other
    vchannels' too), its channel checkpoint and the collection's start position on it.
    `ready`: whether a mix output replaces its visible inputs (`index_ready`; by default
    at once)."""
    own = {s.id: s for s in segments if s.vchannel == vchannel and s.state is not SegmentState.IMPORTING}
    flushed: set[int] = set()
    growing: set[int] = set()
    l0: set[int] = set()
    dropped: set[int] = set()
    pending: set[int] = set()  # invisible compaction outputs: their inputs are served instead
    for seg in own.values():
        if seg.state is SegmentState.DROPPED:
            dropped.add(seg.id)
        elif seg.is_invisible and seg.compaction_from:
            pending.add(seg.id)
        elif seg.level is SegmentLevel.L0:
            l0.add(seg.id)
        elif seg.state is not SegmentState.FLUSHED or seg.is_invisible:
            growing.add(seg.id)
        else:
            flushed.add(seg.id)
    served = _Lineage(own, flushed, growing, ready).resolve(pending)
    replaced = {p for i in served for p in own[i].compaction_from}
    growing -= replaced  # an invisible input its sort output replaced
    live = [s for s in own.values() if s.state is not SegmentState.DROPPED]

    def of(ids: set[int]) -> tuple[SegmentInfo, ...]:
        return tuple(own[i] for i in sorted(ids))

    return QueryView(
        vchannel=vchannel,
        seek_position=checkpoint or _earliest_position(live) or start_position,
        checkpoint=checkpoint,
        flushed=of(served),
        growing=of(growing),
        l0=of(l0),
        dropped=of(dropped - served),
    )


class _Lineage:
    """Which segments are served as flushed, compaction lineage resolved (module docstring)."""

    def __init__(
        self, own: Mapping[int, SegmentInfo], flushed: set[int], growing: set[int], ready: Ready
    ) -> None:
        self.own = own
        self.ready = ready
        self.flushed = flushed  # visible Flushed segments, before lineage
        self.growing = growing
        self.served: set[int] = set()
        self.seen: set[int] = set()
        self.input_served: dict[int, bool] = {}

    def resolve(self, pending: set[int]) -> set[int]:
        for seg_id in sorted(self.flushed | pending):
            if self.own[seg_id].compaction_from:
                self._serve(seg_id, pending)
            else:  # (most segments: no lineage to resolve, never pending)
                self.served.add(seg_id)
        return self.served

    def _serve(self, seg_id: int, pending: set[int]) -> None:
        """Serve the segment, or (an output that cannot replace its inputs yet) its inputs."""
        if seg_id in self.seen or seg_id in self.growing:  # growing ones are served as such
            return
        self.seen.add(seg_id)
        seg = self.own[seg_id]
        if seg_id not in pending and self._replaces_inputs(seg):
            self.served.add(seg_id)
            return
        for parent in seg.compaction_from:
            if parent in self.own:
                self._serve(parent, pending)

    def _replaces_inputs(self, seg: SegmentInfo) -> bool:
        parents = [self.own.get(p) for p in seg.compaction_from]
        if not parents or any(p is None for p in parents):
            return True  # not a compaction output, or its inputs are collected
        if self._an_input_is_served(seg):
            return False
        if any(p is not None and p.is_invisible for p in parents):
            return True  # a sort output replaces its invisible input at once
        return self.ready(seg)

    def _an_input_is_served(self, seg: SegmentInfo) -> bool:
        """An input of `seg`, or an input of one of them (all still in meta), is served as
        flushed: the compaction that made `seg` has not committed."""
        if seg.id in self.input_served:
            return self.input_served[seg.id]
        self.input_served[seg.id] = False  # (a malformed cycle of lineage ends here)
        found = [self.own.get(p) for p in seg.compaction_from]
        parents = [p for p in found if p is not None]
        served = bool(found) and len(parents) == len(found)
        served = served and any(p.id in self.flushed or self._an_input_is_served(p) for p in parents)
        self.input_served[seg.id] = served
        return served


def _earliest_position(segments: Sequence[SegmentInfo]) -> MsgPosition | None:
    """The earliest dml position (else start position) of `segments` by timestamp."""
    positions = [p for s in segments if (p := s.dml_position or s.start_position) is not None]
    return min(positions, key=lambda p: (p.timestamp, p.offset), default=None)


# --- reading the view from etcd ----------------------------------------------------------------


def collection_segments(
    store: MetaStore, collection_id: int, vchannel: str | None = None
) -> list[SegmentInfo]:
    """Every segment of a collection, or of one of its vchannels (read through that
    vchannel's index and dropped records: none of the other vchannels' values), in any
    state (Dropped ones included), in key order (a malformed value is logged and skipped: a
    reader goes on past it)."""
    found = SegmentMeta(store).list(
        collection_id, vchannel=vchannel, skip_malformed=True, include_dropped=True
    )
    return [d.model for d in found]


def read_checkpoints(store: MetaStore, vchannels: Iterable[str]) -> dict[str, MsgPosition | None]:
    """The channel checkpoints of `vchannels`, read *before* the segment meta the views are
    built from is listed. A sync commits its segment meta, then its checkpoint: a checkpoint
    read after the listing can cover rows that the listed meta does not hold yet, in no
    segment and not in the log after the checkpoint either (lost to the read). Read first,
    the checkpoint is at worst behind the segments: the rows between are in both, and the
    log tail skips those at or below their segment's dml position."""
    vchannels = list(vchannels)
    return checkpoints_of(vchannels, store.get_many([store.keys.channel_checkpoint(v) for v in vchannels]))


def checkpoints_of(
    vchannels: Sequence[str], found: Sequence[KeyValue | None]
) -> dict[str, MsgPosition | None]:
    """vchannel -> its checkpoint, from the values of their keys read in that order (a
    malformed one raises, naming its key)."""
    return {
        v: None if kv is None else decode(kv.key, kv.value, MsgPosition)
        for v, kv in zip(vchannels, found, strict=True)
    }


def read_query_view(
    store: MetaStore,
    info: CollectionInfo,
    vchannel: str,
    segments: Sequence[SegmentInfo] | None = None,
    checkpoints: Mapping[str, MsgPosition | None] | None = None,
    ready: Ready | None = None,
) -> QueryView:
    """The query view of one vchannel of the collection, from etcd: its checkpoint, and
    its segments (the vchannel's only: a view of one vchannel of a collection of 100,000
    segments reads its own), or `segments` when the caller has listed the collection's
    already, then with `checkpoints` it read before: `read_checkpoints`. `ready`:
    `index_ready` of the read's time (default: now)."""
    if checkpoints is None or vchannel not in checkpoints:
        checkpoints = read_checkpoints(store, [vchannel])
    if segments is None:
        segments = collection_segments(store, info.id, vchannel)
    if ready is None:
        ready = index_ready(store, info.id)
    return query_view(segments, vchannel, checkpoints[vchannel], start_position(info, vchannel), ready)


def collection_views(
    store: MetaStore,
    info: CollectionInfo,
    segments: Sequence[SegmentInfo] | None = None,
    checkpoints: Mapping[str, MsgPosition | None] | None = None,
    ts: int | None = None,
    indexes: Sequence[FieldIndex] | None = None,
) -> list[QueryView]:
    """The query view of each vchannel of the collection (and of any other vchannel its
    segments name, so that no segment goes unseen), for a read at `ts` (None: now). A
    caller that lists `segments` itself passes the `checkpoints` it read before
    (`read_checkpoints`), and may pass the live `indexes` it listed with them (`index_ready`)."""
    if checkpoints is None:
        checkpoints = read_checkpoints(store, info.vchannels)
    if segments is None:
        segments = collection_segments(store, info.id)
    # each view gets its own vchannel's segments (one pass here, not one per vchannel)
    by_vchannel: dict[str, list[SegmentInfo]] = {v: [] for v in info.vchannels}
    for seg in segments:
        by_vchannel.setdefault(seg.vchannel, []).append(seg)
    vchannels = [*info.vchannels, *sorted(by_vchannel.keys() - set(info.vchannels))]
    ready = index_ready(store, info.id, ts, indexes)
    return [read_query_view(store, info, v, by_vchannel[v], checkpoints, ready) for v in vchannels]


def readable_ids(views: Iterable[QueryView]) -> set[int]:
    """The segments whose rows a reader of these views returns."""
    return {s.id for view in views for s in view.readable}


def delete_paths(views: Iterable[QueryView], partition_id: int) -> list[str]:
    """The delta logs that apply to a partition: a partition spans every vchannel, and a
    delete removes the older rows of its pk anywhere in the partition."""
    return [path for view in views for path in view.delta_paths(partition_id)]
