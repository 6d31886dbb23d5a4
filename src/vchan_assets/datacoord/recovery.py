"""Recovery info per vchannel (Milvus' DataNode recovery design) and orphan binlogs.

A DataNode restarting a vchannel asks for the same thing as one starting it: where to
seek (the channel checkpoint, or the collection's start position), and which segments
are unflushed, flushed or dropped, with their meta.
"""

from __future__ import annotations

from dataclasses import dataclass

from vchan_assets.datacoord.collections import VchannelNotFoundError
from vchan_assets.meta.codec import decode
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import (
    CollectionInfo,
    MsgPosition,
    RecoveryInfo,
    SegmentInfo,
    SegmentState,
    VchannelInfo,
)
from vchan_assets.storage import Storage
from vchan_assets.storage.layout import BINLOG_ROOTS


def channel_checkpoint(store: MetaStore, vchannel: str) -> Decoded[MsgPosition] | None:
    return store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)


def channel_segments(store: MetaStore, collection_id: int, vchannel: str) -> list[Decoded[SegmentInfo]]:
    """Every segment of the collection on this vchannel, with its etcd version, the Dropped
    ones included: a sync leaves out the rows of a dropped segment still in its log, and
    recovery reports their ids, as Milvus' DataNode gets them."""
    return SegmentMeta(store).list(collection_id, vchannel=vchannel, include_dropped=True)


def start_position(collection: CollectionInfo, vchannel: str) -> MsgPosition:
    for position in collection.start_positions:
        if position.channel == vchannel:
            return position
    return MsgPosition(vchannel, -1, 0)


def recovery_info(store: MetaStore, collection: CollectionInfo, vchannel: str) -> RecoveryInfo:
    if vchannel not in collection.vchannels:
        raise VchannelNotFoundError(vchannel, collection.name)
    checkpoint = channel_checkpoint(store, vchannel)
    segments = [d.model for d in channel_segments(store, collection.id, vchannel)]
    return _recovery(collection, vchannel, checkpoint.model if checkpoint else None, segments)


def _recovery(
    collection: CollectionInfo, vchannel: str, checkpoint: MsgPosition | None, segments: list[SegmentInfo]
) -> RecoveryInfo:
    seek = checkpoint or start_position(collection, vchannel)
    by_state: dict[str, list[int]] = {"unflushed": [], "flushed": [], "dropped": []}
    for seg in segments:
        if seg.state is SegmentState.FLUSHED:
            by_state["flushed"].append(seg.id)
        elif seg.state is SegmentState.DROPPED:
            by_state["dropped"].append(seg.id)
        else:
            by_state["unflushed"].append(seg.id)
    return RecoveryInfo(
        vchannel=vchannel,
        collection_id=collection.id,
        seek_position=seek,
        unflushed_segment_ids=tuple(sorted(by_state["unflushed"])),
        flushed_segment_ids=tuple(sorted(by_state["flushed"])),
        dropped_segment_ids=tuple(sorted(by_state["dropped"])),
        segments=tuple(segments),
    )


class RecoverySnapshot:
    """Recovery info of many channels from one read of every checkpoint and one of each
    collection's segments, made on first use: a coordinator step assigning hundreds of
    channels reads etcd a few times instead of twice per channel. What it gives a ToWatch
    is read before the lease is granted: the DataNode reads the channel again once it holds
    the lease and checks the two against each other (`compare_recovery`)."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self._checkpoints: dict[str, bytes] | None = None
        self._segments: dict[int, list[SegmentInfo]] = {}

    def recovery_info(self, collection: CollectionInfo, vchannel: str) -> RecoveryInfo:
        if vchannel not in collection.vchannels:
            raise VchannelNotFoundError(vchannel, collection.name)
        if self._checkpoints is None:
            snap = self.store.list_prefix(self.store.keys.channel_checkpoint.prefix)
            self._checkpoints = {kv.key: kv.value for kv in snap.items}
        key = self.store.keys.channel_checkpoint(vchannel)
        raw = self._checkpoints.get(key)
        checkpoint = None if raw is None else decode(key, raw, MsgPosition)  # only this channel's
        if collection.id not in self._segments:
            found = SegmentMeta(self.store).list(collection.id, include_dropped=True)  # as channel_segments
            self._segments[collection.id] = [d.model for d in found]
        segments = [s for s in self._segments[collection.id] if s.vchannel == vchannel]
        return _recovery(collection, vchannel, checkpoint, segments)


_SEGMENT_STAGES = ("unflushed", "flushed", "dropped")


@dataclass(frozen=True)
class RecoveryDiff:
    """How a channel's meta, read by the node that now holds its lease, differs from the
    VchannelInfo the coordinator wrote into the ToWatch.

    Meta only moves forward (checkpoints advance; a segment goes unflushed -> flushed ->
    dropped, then is forgotten), so `advanced` is what was committed between the
    coordinator's read and the lease grant: the node's reading is the newer one. Anything in
    `regressed` means meta went back in time behind the coordinator's view, e.g. etcd
    restored from an older backup."""

    advanced: tuple[str, ...] = ()
    regressed: tuple[str, ...] = ()


def compare_recovery(assigned: VchannelInfo, found: RecoveryInfo) -> RecoveryDiff:
    advanced: list[str] = []
    regressed: list[str] = []
    if assigned.seek_position is not None and found.seek_position is not None:
        was, now = assigned.seek_position.offset, found.seek_position.offset
        if now > was:
            advanced.append(f"checkpoint offset {was} -> {now}")
        elif now < was:
            regressed.append(f"checkpoint at offset {now}, assigned at {was}")
    before, after = _segment_stages(assigned), _segment_stages(found)
    for segment_id, stage in sorted(before.items()):
        later = after.get(segment_id, len(_SEGMENT_STAGES))  # forgotten: past dropped
        change = f"segment {segment_id} {_stage_name(stage)} -> {_stage_name(later)}"
        if later > stage:
            advanced.append(change)
        elif later < stage:
            regressed.append(change)
    return RecoveryDiff(tuple(advanced), tuple(regressed))


def _segment_stages(info: VchannelInfo | RecoveryInfo) -> dict[int, int]:
    groups = (info.unflushed_segment_ids, info.flushed_segment_ids, info.dropped_segment_ids)
    return {segment_id: stage for stage, ids in enumerate(groups) for segment_id in ids}


def _stage_name(stage: int) -> str:
    return _SEGMENT_STAGES[stage] if stage < len(_SEGMENT_STAGES) else "forgotten"


def referenced_paths(store: MetaStore) -> set[str]:
    """Every binlog, delta log and stats log key that segment meta (live or Dropped: GC
    deletes a dropped segment's files after its tolerance) points to."""
    segments = SegmentMeta(store).list(include_dropped=True)
    paths: set[str] = set()
    for decoded in segments:
        seg = decoded.model
        paths.update(b.path for b in seg.binlog_files)
        paths.update(b.path for b in seg.deltalogs)
        paths.update(b.path for b in seg.statslogs)
    return paths


def list_orphans(store: MetaStore, storage: Storage) -> list[str]:
    """Binlog files no segment meta points to (left by a crash before the meta commit,
    or by a writer whose lease was revoked): candidates for garbage collection."""
    referenced = referenced_paths(store)
    orphans = []
    for root in BINLOG_ROOTS:
        for info in storage.list_files(root + "/"):
            key = storage.key_of(info.path)
            if key not in referenced:
                orphans.append(key)
    return orphans
