"""Segment allocation, sealing and flush: DataCoord's segment manager (as Milvus' DataCoord server).

Lifecycle of an L1 segment and who moves it:

    Growing --seal policy--> Sealed  --+
       |                               +--(DataNode sync)--> Flushed   (or Dropped if empty)
       +------flush()------> Flushing -+

- The producer asks for segment IDs inside its append, holding the channel's append
  lock (`meta.channel_head`): the open segments of a channel and their allocated rows
  are part of the channel's head in etcd, so every producer process, the coordinator
  and every flushing client see and change the same allocation (one authority).
  New segments are created Growing in etcd in the transaction that opens them on the head.
- Sealing (by a policy, by `flush`, or full at allocation) takes the segment off the
  head under the same lock and stamps `seal_ts` above the head's last timestamp, then
  moves the head's last timestamp to `seal_ts`: every row of the segment has a smaller
  timestamp, every later message of the channel a larger one.
- The DataNode sync moves Sealed/Flushing to Flushed when it commits a log range whose
  end time tick has `timestamp >= seal_ts` (then every row of the segment is in
  binlogs), or to Dropped if it has no rows.
- `flush_state` is true once every channel checkpoint passed the flush timestamp and
  every segment sealed at or before it is Flushed or Dropped.
- `recover_flushing` (at start, like Milvus' handleFlushingSegments) completes segments
  whose channel checkpoint already passed their `seal_ts`.

Segment meta is also written by the DataNode (binlogs, rows, positions, state) in
lease-guarded transactions that compare versions, so every write here is a
read-modify-write of the whole SegmentInfo with compare-and-swap on the version read,
retried after a conflict: nothing the node wrote is lost.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from vchan_assets.config import Settings
from vchan_assets.datacoord import segment_ops
from vchan_assets.datacoord.collections import CollectionNotFoundError
from vchan_assets.datacoord.segment_ops import SEALABLE
from vchan_assets.meta.allocator import IdAllocator, TimestampOracle
from vchan_assets.meta.channel_head import ChannelHeads, HeldChannel
from vchan_assets.meta.errors import CasConflictError, SegmentNotFoundError
from vchan_assets.meta.retry import retry_on_conflict
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore, Value
from vchan_assets.model import (
    ChannelHead,
    CollectionInfo,
    MsgPosition,
    OpenSegment,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
FINAL = (SegmentState.FLUSHED, SegmentState.DROPPED)


# What the seal policies look at: an open segment as its channel head holds it.
SegmentAllocation = OpenSegment

# A seal policy returns why the segment should be sealed now, or None.
SealPolicy = Callable[[SegmentAllocation, float], str | None]


def seal_by_capacity(proportion: float) -> SealPolicy:
    """Milvus' sealL1SegmentByCapacity: seal once the rows handed out reach `proportion`
    of max_rows (dataCoord.segment.sealProportion; segments are merged later by compaction)."""

    def policy(seg: SegmentAllocation, now: float) -> str | None:
        if seg.allocated >= proportion * seg.max_rows:
            return f"capacity: {seg.allocated} rows >= {proportion:g} x {seg.max_rows}"
        return None

    return policy


def seal_by_lifetime(max_life: float) -> SealPolicy:
    """Milvus' sealL1SegmentByLifetime: seal a segment older than `max_life` seconds."""

    def policy(seg: SegmentAllocation, now: float) -> str | None:
        age = now - seg.created_at
        return f"lifetime: {age:.0f}s >= {max_life:g}s" if age >= max_life else None

    return policy


def seal_by_idle(max_idle: float) -> SealPolicy:
    """Milvus' sealL1SegmentByIdleTime: seal a segment that has rows but received none
    for `max_idle` seconds."""

    def policy(seg: SegmentAllocation, now: float) -> str | None:
        idle = now - seg.last_insert_at
        if seg.allocated > 0 and idle >= max_idle:
            return f"idle: no insert for {idle:.0f}s >= {max_idle:g}s"
        return None

    return policy


def seal_by_binlog_count(max_files: int) -> SealPolicy:
    """Milvus' sealL1SegmentByBinlogFileNumber (segment.maxBinlogFileNumber): seal a segment
    whose column group holds `max_files` binlogs. Every sync appends to the segment's one
    etcd value; a segment that never fills would outgrow etcd's request limit."""

    def policy(seg: SegmentAllocation, now: float) -> str | None:
        if seg.binlog_files >= max_files:
            return f"binlog files: {seg.binlog_files} >= {max_files}"
        return None

    return policy


def default_seal_policies(settings: Settings) -> tuple[SealPolicy, ...]:
    return (
        seal_by_capacity(settings.segment_seal_proportion),
        seal_by_lifetime(settings.segment_max_life),
        seal_by_idle(settings.segment_max_idle),
        seal_by_binlog_count(settings.segment_max_binlog_files),
    )


def max_rows_of(collection: CollectionInfo, settings: Settings) -> int:
    """Segment capacity in rows: segment_max_size_mb over the schema's estimated row size."""
    return max(1, int(settings.segment_max_size_mb * MiB // collection.schema.row_bytes()))


def _ids_in(ids: set[int]) -> Callable[[OpenSegment], bool]:
    return lambda seg: seg.segment_id in ids


def _of(seg: OpenSegment, collection_id: int, partition_id: int) -> bool:
    return seg.collection_id == collection_id and seg.partition_id == partition_id


@dataclass(frozen=True)
class SealedSegment:
    segment_id: int
    collection_id: int
    partition_id: int
    vchannel: str
    seal_ts: int
    reason: str


@dataclass(frozen=True)
class FlushProgress:
    """Why a flush is not done yet (empty tuples: done)."""

    collection_id: int
    flush_ts: int
    lagging_channels: tuple[tuple[str, int | None], ...]  # (vchannel, checkpoint ts or None)
    pending_segments: tuple[int, ...]  # sealed at or before flush_ts, not Flushed/Dropped

    @property
    def done(self) -> bool:
        return not self.lagging_channels and not self.pending_segments


class RecoveryAction(enum.StrEnum):
    FLUSHED = "flushed"
    DROPPED = "dropped"
    PENDING = "pending"  # the DataNode's next sync completes it


@dataclass(frozen=True)
class FlushRecovery:
    segment_id: int
    vchannel: str
    action: RecoveryAction
    reason: str


class SegmentManager:
    """Allocates growing segments per (collection, partition, vchannel), seals, flushes.

    The open segments of a channel live in its head in etcd (`meta.channel_head`), and
    every change of them holds the channel's append lock, as the appends do: so any
    number of producers, the coordinator and flushing clients share one allocation
    authority, and a seal is ordered with the appends around it. `seal_ts` is above the
    head's last timestamp, and the head's last timestamp becomes `seal_ts`, so every row
    of a sealed segment has a smaller timestamp and every later message a larger one."""

    def __init__(
        self,
        store: MetaStore,
        settings: Settings,
        ids: IdAllocator | None = None,
        tso: TimestampOracle | None = None,
        policies: Sequence[SealPolicy] | None = None,
        clock: Callable[[], float] = time.time,
        heads: ChannelHeads | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.ids = ids or IdAllocator(store)
        self.tso = tso or TimestampOracle(store)
        self.heads = heads or ChannelHeads(
            store, settings.append_lock_ttl, settings.append_lock_ttl + settings.client_retry_timeout
        )
        self.policies = tuple(default_seal_policies(settings) if policies is None else policies)
        self.clock = clock
        self.cas_retries = 0  # writes retried after a concurrent change (each is logged)
        self._max_rows: dict[int, int] = {}

    # --- allocation on a held channel --------------------------------------------------------

    def open_for(
        self, held: HeldChannel, collection_id: int, partition_id: int, count: int, now: float
    ) -> None:
        """Make sure the open segments of (collection, partition) on the held channel have
        room for `count` rows: new segments are created Growing in etcd together with the
        head that lists them (one transaction), so no row ever names a segment etcd lacks."""
        head = held.head
        free = sum(s.free for s in head.open_segments if _of(s, collection_id, partition_id))
        if free >= count:
            return
        max_rows = self.max_rows(collection_id)
        opened: list[OpenSegment] = []
        puts: dict[str, Value] = {}
        while free < count:
            segment_id = self.ids.alloc()
            info = SegmentInfo(
                id=segment_id,
                collection_id=collection_id,
                partition_id=partition_id,
                vchannel=head.vchannel,
                state=SegmentState.GROWING,
                max_rows=max_rows,
                created_at=now,
                last_insert_at=now,
            )
            puts.update(SegmentMeta(self.store).create_puts(info))
            opened.append(
                OpenSegment(segment_id, collection_id, partition_id, max_rows, 0, now, now, 0, head.vchannel)
            )
            free += max_rows
        held.commit(replace(head, open_segments=head.open_segments + tuple(opened)), puts)
        for seg in opened:
            log.info(
                "opened segment %d on %s (partition %d, max %d rows)",
                seg.segment_id,
                head.vchannel,
                partition_id,
                max_rows,
            )

    def allocate(
        self,
        head: ChannelHead,
        collection_id: int,
        partition_id: int,
        count: int,
        ts: int,
        now: float,
        apply_policies: bool = False,
    ) -> tuple[ChannelHead, list[tuple[int, int]], list[tuple[OpenSegment, str]]]:
        """Hand out `count` rows stamped `ts` from the open segments (`open_for` first):
        (the head after it, [(segment_id, rows)], segments to seal now with why). A full
        segment, or with `apply_policies` one the seal policies pick, leaves the open
        list here."""
        out: list[tuple[int, int]] = []
        remaining = count
        segments: list[OpenSegment] = []
        for seg in head.open_segments:
            if remaining and _of(seg, collection_id, partition_id) and seg.free:
                n = min(seg.free, remaining)
                seg = replace(
                    seg, allocated=seg.allocated + n, last_insert_at=now, last_ts=max(seg.last_ts, ts)
                )
                out.append((seg.segment_id, n))
                remaining -= n
            segments.append(seg)
        if remaining:
            raise ValueError(f"{head.vchannel}: no room for {remaining} rows (open_for was not called)")
        touched = {s for s, _ in out}
        chosen = []
        for seg in segments:
            if seg.segment_id in touched:
                reasons = []
                if apply_policies:  # (the binlog count is the DataNode's: read from etcd)
                    counted = replace(seg, binlog_files=self._binlog_files(seg))
                    reasons = [r for r in (p(counted, now) for p in self.policies) if r]
                if seg.free == 0:
                    reasons.append("full: max_rows reached")
                if reasons:
                    chosen.append((seg, "; ".join(dict.fromkeys(reasons))))
        gone = {s.segment_id for s, _ in chosen}
        kept = tuple(s for s in segments if s.segment_id not in gone)
        return replace(head, open_segments=kept, last_ts=max(head.last_ts, ts)), out, chosen

    def seal_left(
        self,
        chosen: Sequence[tuple[OpenSegment, str]],
        seal_ts: int,
        state: SegmentState = SegmentState.SEALED,
    ) -> list[SealedSegment]:
        """Seal segments that already left their channel's open list at `seal_ts` (above
        every timestamp they were handed out with)."""
        sealed = []
        for seg, reason in chosen:
            key = self.store.keys.segment(seg.collection_id, seg.partition_id, seg.segment_id)
            self.update_segment(key, partial(segment_ops.seal, seal_ts=seal_ts, state=state))
            sealed.append(
                SealedSegment(
                    seg.segment_id, seg.collection_id, seg.partition_id, seg.vchannel, seal_ts, reason
                )
            )
            log.info("sealed segment %d on %s at ts %d: %s", seg.segment_id, seg.vchannel, seal_ts, reason)
        return sealed

    def next_ts(self, head: ChannelHead, count: int = 1, at_least: int = 0) -> int:
        """The last of `count` timestamps for the held channel, from the oracle, above the
        channel's last (a mark an older version persisted may be behind it). From
        `at_least` on when given: a timestamp the caller took from the oracle already (a
        flush's), used as it is where the channel is still below it, so that one flush
        seals every channel at one timestamp."""
        if at_least > head.last_ts:
            return at_least + count - 1
        return self.tso.alloc(count, above=max(head.last_ts, at_least - 1))

    # --- allocation as one call ----------------------------------------------------------------

    def assign(
        self,
        collection_id: int,
        partition_id: int,
        vchannel: str,
        count: int,
        ts: int,
        now: float | None = None,
    ) -> list[tuple[int, int]]:
        """Hand out `count` rows: [(segment_id, rows)], filling the open segment of
        (collection, partition, vchannel) and spilling into new ones at max_rows.
        A segment that becomes full is sealed at once. (The producer does the same
        steps inside its append, under the same lock.)"""
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        now = self.clock() if now is None else now
        with self.heads.hold(vchannel) as held:
            self.open_for(held, collection_id, partition_id, count, now)
            head, out, chosen = self.allocate(held.head, collection_id, partition_id, count, ts, now)
            seal_ts = self.next_ts(head) if chosen else head.last_ts
            held.commit(replace(head, last_ts=seal_ts), release=True)
        self.seal_left(chosen, seal_ts)
        return out

    def max_rows(self, collection_id: int) -> int:
        if collection_id not in self._max_rows:
            found = self.store.get_model(self.store.keys.collection(collection_id), CollectionInfo)
            if found is None:
                raise CollectionNotFoundError(collection_id)
            self._max_rows[collection_id] = max_rows_of(found.model, self.settings)
        return self._max_rows[collection_id]

    def growing(self, collection_id: int | None = None) -> list[OpenSegment]:
        """The open segments of every channel head (of one collection, or all)."""
        return [
            seg
            for head in self.heads.all()
            for seg in head.open_segments
            if collection_id is None or seg.collection_id == collection_id
        ]

    # --- sealing -------------------------------------------------------------------------

    def seal_by_policy(
        self, now: float | None = None, vchannels: Iterable[str] | None = None
    ) -> list[SealedSegment]:
        """Apply the seal policies to the open segments (of `vchannels`, or every channel)
        and seal those that qualify."""
        now = self.clock() if now is None else now
        heads = self.heads.all() if vchannels is None else [h for h in map(self.heads.read, vchannels) if h]
        sealed = []
        for head in heads:
            found = {
                s.segment_id: self._reasons(replace(s, binlog_files=self._binlog_files(s)), now)
                for s in head.open_segments
            }
            wanted = {segment_id: reason for segment_id, reason in found.items() if reason}
            if wanted:
                sealed += self._seal_open(head.vchannel, _ids_in(set(wanted)), wanted, SegmentState.SEALED)
        return sealed

    def _binlog_files(self, seg: OpenSegment) -> int:
        """The segment's binlog count per column group, from etcd (the DataNode writes it)."""
        key = self.store.keys.segment(seg.collection_id, seg.partition_id, seg.segment_id)
        found = self.store.get_model(key, SegmentInfo)
        if found is None:
            return seg.binlog_files
        return max((len(g.logs) for g in found.model.binlogs), default=0)

    def _reasons(self, seg: OpenSegment, now: float) -> str:
        return "; ".join(r for r in (p(seg, now) for p in self.policies) if r)

    def _seal_open(
        self,
        vchannel: str,
        pick: Callable[[OpenSegment], bool],
        reasons: Mapping[int, str] | str,
        state: SegmentState,
        at_least: int = 0,
    ) -> list[SealedSegment]:
        """Under the channel's lock: take the picked open segments off the head, move the
        head's last timestamp to the seal timestamp, then seal them in etcd."""
        with self.heads.hold(vchannel) as held:
            head = held.head
            chosen = [
                (s, reasons if isinstance(reasons, str) else reasons[s.segment_id])
                for s in head.open_segments
                if pick(s)
            ]
            if not chosen:
                return []
            seal_ts = self.next_ts(head, 1, at_least)
            gone = {s.segment_id for s, _ in chosen}
            kept = tuple(s for s in head.open_segments if s.segment_id not in gone)
            held.commit(replace(head, open_segments=kept, last_ts=seal_ts))
            return self.seal_left(chosen, seal_ts, state)

    def seal_orphans(self, listed: Sequence[SegmentInfo] | None = None) -> list[SealedSegment]:
        """Seal Growing L1 segments that no channel head lists (their sealer died between
        taking them off the head and sealing them): they can receive no more rows, and
        the head's last timestamp is above all of theirs. `listed`: every segment, as the
        caller just listed them (else listed here)."""
        open_ids = {s.segment_id for h in self.heads.all() for s in h.open_segments}
        if listed is None:
            listed = [d.model for d in SegmentMeta(self.store).list(skip_malformed=True)]
        sealed = []
        for seg in listed:
            if seg.state is not SegmentState.GROWING or seg.level is SegmentLevel.L0 or seg.id in open_ids:
                continue
            head = self.heads.read(seg.vchannel)
            if head is not None and any(s.segment_id == seg.id for s in head.open_segments):
                continue  # opened since the listing
            seal_ts = self.next_ts(head or ChannelHead(seg.vchannel))
            orphan = OpenSegment(
                seg.id, seg.collection_id, seg.partition_id, seg.max_rows, vchannel=seg.vchannel
            )
            sealed += self.seal_left([(orphan, "orphan: on no channel head")], seal_ts)
        return sealed

    def flush(self, collection_id: int) -> int:
        """Seal every growing segment of the collection (state Flushing) and return the
        flush timestamp: above the timestamp of every row handed out before. The caller
        then appends a time tick at or above it to every channel (`Producer.flush`)."""
        found = self.store.get_model(self.store.keys.collection(collection_id), CollectionInfo)
        if found is None:
            raise CollectionNotFoundError(collection_id)
        # One seal timestamp for every channel if it can be: above every channel's last
        # (a channel that moved past it meanwhile gets a larger one, and flush_ts is the largest).
        heads = [h for h in map(self.heads.read, found.model.vchannels) if h is not None]
        flush_ts = self.tso.alloc(above=max((h.last_ts for h in heads), default=0))
        for vchannel in found.model.vchannels:
            sealed = self._seal_open(
                vchannel,
                lambda s: s.collection_id == collection_id,
                "flush",
                SegmentState.FLUSHING,
                flush_ts,
            )
            flush_ts = max([flush_ts, *(s.seal_ts for s in sealed)])
        # From etcd as well: segments sealed by policy move to Flushing (the sync should
        # run now), and Growing ones on no head (orphans) are sealed above their channel's
        # last timestamp. A segment open on a head now was opened after this flush sealed
        # its channel: its rows come after flush_ts, it is not part of this flush.
        segments = SegmentMeta(self.store).list(collection_id)
        now_heads = {h.vchannel: h for h in map(self.heads.read, found.model.vchannels) if h is not None}
        open_ids = {s.segment_id for h in now_heads.values() for s in h.open_segments}
        for decoded in segments:
            seg = decoded.model
            if seg.level is SegmentLevel.L0 or seg.id in open_ids:
                continue
            if seg.state is SegmentState.GROWING:
                head = now_heads.get(seg.vchannel)
                flush_ts = max(flush_ts, head.last_ts + 1 if head else 0)
            if seg.state in (SegmentState.GROWING, SegmentState.SEALED):
                self.update_segment(decoded.kv.key, partial(segment_ops.mark_flushing, flush_ts=flush_ts))
        log.info("flush of collection %d at ts %d", collection_id, flush_ts)
        return flush_ts

    # --- flush state and recovery --------------------------------------------------------

    def flush_progress(self, collection_id: int, flush_ts: int) -> FlushProgress:
        found = self.store.get_model(self.store.keys.collection(collection_id), CollectionInfo)
        if found is None:
            raise CollectionNotFoundError(collection_id)
        lagging = []
        for vchannel in found.model.vchannels:
            cp = self.store.get_model(self.store.keys.channel_checkpoint(vchannel), MsgPosition)
            if cp is None or cp.model.timestamp < flush_ts:
                lagging.append((vchannel, cp.model.timestamp if cp else None))
        segments = SegmentMeta(self.store).list(collection_id)
        pending = sorted(
            d.model.id for d in segments if d.model.state in SEALABLE and d.model.seal_ts <= flush_ts
        )
        return FlushProgress(collection_id, flush_ts, tuple(lagging), tuple(pending))

    def flush_state(self, collection_id: int, flush_ts: int) -> bool:
        """True when every vchannel's checkpoint reached flush_ts and every segment
        sealed at or before flush_ts is Flushed or Dropped (Milvus' GetFlushState)."""
        return self.flush_progress(collection_id, flush_ts).done

    def recover_flushing(self) -> list[FlushRecovery]:
        """At start: Sealed/Flushing segments whose channel checkpoint already passed
        their seal_ts hold all their rows in binlogs (segment meta is committed before
        the checkpoint), so they are completed here: Flushed, or Dropped if empty.
        The others are reported as pending: the DataNode sync completes them."""
        found = SegmentMeta(self.store).list(skip_malformed=True)
        checkpoints: dict[str, MsgPosition | None] = {}
        out = []
        for decoded in found:
            seg = decoded.model
            if seg.state not in SEALABLE:
                continue
            if seg.vchannel not in checkpoints:
                cp = self.store.get_model(self.store.keys.channel_checkpoint(seg.vchannel), MsgPosition)
                checkpoints[seg.vchannel] = cp.model if cp else None
            cp_pos = checkpoints[seg.vchannel]
            if seg.seal_ts <= 0 or cp_pos is None or cp_pos.timestamp < seg.seal_ts:
                reason = f"checkpoint {cp_pos.timestamp if cp_pos else None} < seal_ts {seg.seal_ts}"
                out.append(FlushRecovery(seg.id, seg.vchannel, RecoveryAction.PENDING, reason))
                continue
            updated = self.update_segment(
                decoded.kv.key, partial(segment_ops.complete_flush, position=cp_pos)
            )
            action = (
                RecoveryAction.FLUSHED if updated.state is SegmentState.FLUSHED else RecoveryAction.DROPPED
            )
            reason = f"checkpoint ts {cp_pos.timestamp} passed seal_ts {seg.seal_ts}"
            log.warning("recovered segment %d on %s: %s (%s)", seg.id, seg.vchannel, action, reason)
            out.append(FlushRecovery(seg.id, seg.vchannel, action, reason))
        return out

    # --- drops ------------------------------------------------------------------------------

    def drop_collection(self, collection_id: int) -> list[int]:
        """Mark every segment of a dropped collection Dropped (its files go to GC)."""
        return self._drop(collection_id, None)

    def drop_partition(self, collection_id: int, partition_id: int) -> list[int]:
        """Mark every segment of a dropped partition Dropped (its files go to GC)."""
        return self._drop(collection_id, partition_id)

    def _drop(self, collection_id: int, partition_id: int | None) -> list[int]:
        def doomed(seg: OpenSegment) -> bool:
            return seg.collection_id == collection_id and partition_id in (None, seg.partition_id)

        for head in self.heads.all():
            if any(doomed(s) for s in head.open_segments):
                with self.heads.hold(head.vchannel) as held:
                    kept = tuple(s for s in held.head.open_segments if not doomed(s))
                    held.commit(replace(held.head, open_segments=kept))
        if partition_id is None:
            self._max_rows.pop(collection_id, None)
        found = SegmentMeta(self.store).list(collection_id)
        dropped = []
        for decoded in found:
            seg = decoded.model
            if seg.state is SegmentState.DROPPED or (
                partition_id is not None and seg.partition_id != partition_id
            ):
                continue
            self.update_segment(decoded.kv.key, segment_ops.drop)
            dropped.append(seg.id)
        return dropped

    # --- compare-and-swap ----------------------------------------------------------------

    def update_segment(self, key: str, change: Callable[[SegmentInfo], SegmentInfo | None]) -> SegmentInfo:
        """Read-modify-write of one SegmentInfo with CAS on the version read; re-read and
        retry when the DataNode (or anyone) changed it meanwhile. `change` returns None
        when nothing needs to be written."""

        door = SegmentMeta(self.store)

        def attempt() -> SegmentInfo:
            found = self.store.get_model(key, SegmentInfo)
            if found is None:  # dropped meanwhile (moved to the dropped family), or never there
                gone = door.dropped_of(key)
                if gone is None:
                    raise SegmentNotFoundError(key)
                return gone.model  # no operation changes a Dropped segment
            new = change(found.model)
            if new is None or new == found.model:
                return found.model
            return door.swap(found.kv.version, new).model

        return retry_on_conflict(f"segment {key}", attempt, on_conflict=self._count_conflict)

    def _count_conflict(self, exc: CasConflictError) -> None:
        self.cas_retries += 1
