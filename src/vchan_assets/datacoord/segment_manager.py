"""Segment allocation, sealing and flush: DataCoord's segment manager (seed: datacoord server).

Lifecycle of an L1 segment and who moves it:

    Growing --seal policy--> Sealed  --+
       |                               +--(DataNode sync)--> Flushed   (or Dropped if empty)
       +------flush()------> Flushing -+

- The producer asks `assign` for segment IDs before appending insert rows; new
  segments are created in etcd as Growing, allocations are counted in memory.
- Sealing (by a policy, or by `flush`) stamps `seal_ts`: a timestamp taken under the
  manager's lock and greater than every `ts` passed to `assign` before, so every row
  of the segment has a smaller timestamp. No row is assigned to it afterwards.
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

One active manager per cluster is assumed (DataCoord is active-standby); allocations
live in its memory and are rebuilt from etcd at start with `num_rows` as the floor.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from vchan_assets.config import Settings
from vchan_assets.datacoord import segment_ops
from vchan_assets.datacoord.collections import CollectionNotFoundError
from vchan_assets.datacoord.segment_ops import SEALABLE
from vchan_assets.meta.allocator import IdAllocator, TimestampOracle
from vchan_assets.meta.errors import CasConflictError, SegmentNotFoundError
from vchan_assets.meta.retry import retry_on_conflict
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    CollectionInfo,
    MsgPosition,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    physical_ms,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
FINAL = (SegmentState.FLUSHED, SegmentState.DROPPED)


@dataclass
class SegmentAllocation:
    """In-memory state of a growing segment: how many rows were handed out."""

    segment_id: int
    collection_id: int
    partition_id: int
    vchannel: str
    max_rows: int
    allocated: int
    created_at: float
    last_insert_at: float
    last_ts: int = 0  # largest timestamp passed to assign for it
    binlog_files: int = 0  # most binlog files of one column group, as last read from etcd

    @property
    def free(self) -> int:
        return max(self.max_rows - self.allocated, 0)


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

    `assign`'s `ts` must come from this manager's oracle (`manager.tso`); the producer
    shares it. Seal timestamps are also kept above every `ts` assign has seen, so the
    rule holds even with another oracle instance."""

    def __init__(
        self,
        store: MetaStore,
        settings: Settings,
        ids: IdAllocator | None = None,
        tso: TimestampOracle | None = None,
        policies: Sequence[SealPolicy] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        self.ids = ids or IdAllocator(store)
        self.tso = tso or TimestampOracle(store)
        self.policies = tuple(default_seal_policies(settings) if policies is None else policies)
        self.clock = clock
        self.cas_retries = 0  # writes retried after a concurrent change (each is logged)
        self._lock = threading.Lock()
        self._growing: dict[tuple[int, int, str], list[SegmentAllocation]] = {}
        self._max_rows: dict[int, int] = {}
        self._max_assigned_ts = 0
        self.reload()

    # --- allocation ----------------------------------------------------------------------

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
        A segment that becomes full is sealed at once."""
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        now = self.clock() if now is None else now
        with self._lock:
            key = (collection_id, partition_id, vchannel)
            segments = self._growing.setdefault(key, [])
            out: list[tuple[int, int]] = []
            remaining = count
            while remaining:
                seg = next((s for s in segments if s.free > 0), None)
                if seg is None:
                    seg = self._open_segment(collection_id, partition_id, vchannel, now)
                    segments.append(seg)
                n = min(seg.free, remaining)
                seg.allocated += n
                seg.last_insert_at = now
                seg.last_ts = max(seg.last_ts, ts)
                out.append((seg.segment_id, n))
                remaining -= n
            self._max_assigned_ts = max(self._max_assigned_ts, ts)
            full = [s for s in segments if s.free == 0]
            if full:
                self._seal_locked([(s, "full: max_rows reached") for s in full], SegmentState.SEALED)
            return out

    def _open_segment(
        self, collection_id: int, partition_id: int, vchannel: str, now: float
    ) -> SegmentAllocation:
        max_rows = self.max_rows(collection_id)
        segment_id = self.ids.alloc()
        info = SegmentInfo(
            id=segment_id,
            collection_id=collection_id,
            partition_id=partition_id,
            vchannel=vchannel,
            state=SegmentState.GROWING,
            level=SegmentLevel.L1,
            max_rows=max_rows,
            created_at=now,
            last_insert_at=now,
        )
        self.store.cas(self.store.keys.segment(collection_id, partition_id, segment_id), 0, info)
        log.info(
            "opened segment %d on %s (partition %d, max %d rows)",
            segment_id,
            vchannel,
            partition_id,
            max_rows,
        )
        return SegmentAllocation(segment_id, collection_id, partition_id, vchannel, max_rows, 0, now, now)

    def max_rows(self, collection_id: int) -> int:
        if collection_id not in self._max_rows:
            found = self.store.get_model(self.store.keys.collection(collection_id), CollectionInfo)
            if found is None:
                raise CollectionNotFoundError(collection_id)
            self._max_rows[collection_id] = max_rows_of(found.model, self.settings)
        return self._max_rows[collection_id]

    def growing(self, collection_id: int | None = None) -> list[SegmentAllocation]:
        """Copies of the growing allocations (of one collection, or all)."""
        with self._lock:
            return [
                replace(s)
                for key, segments in self._growing.items()
                if collection_id is None or key[0] == collection_id
                for s in segments
            ]

    # --- sealing -------------------------------------------------------------------------

    def seal_by_policy(self, now: float | None = None) -> list[SealedSegment]:
        """Apply the seal policies to every growing segment; seal those that qualify."""
        now = self.clock() if now is None else now
        with self._lock:
            chosen = []
            for segments in self._growing.values():
                for seg in segments:
                    seg.binlog_files = self._binlog_files(seg)
                    reasons = [r for r in (p(seg, now) for p in self.policies) if r]
                    if reasons:
                        chosen.append((seg, "; ".join(reasons)))
            return self._seal_locked(chosen, SegmentState.SEALED) if chosen else []

    def _binlog_files(self, seg: SegmentAllocation) -> int:
        """The segment's binlog count per column group, from etcd (the DataNode writes it)."""
        key = self.store.keys.segment(seg.collection_id, seg.partition_id, seg.segment_id)
        found = self.store.get_model(key, SegmentInfo)
        if found is None:
            return seg.binlog_files
        return max((len(g.logs) for g in found.model.binlogs), default=0)

    def flush(self, collection_id: int) -> int:
        """Seal every growing segment of the collection (state Flushing) and return the
        flush timestamp: greater than the timestamp of every row assigned before."""
        with self._lock:
            flush_ts = self._next_seal_ts()
            for key in [k for k in self._growing if k[0] == collection_id]:
                del self._growing[key]
            # From etcd, not memory: also seals segments another manager opened, and
            # moves segments sealed by policy to Flushing (the sync should run now).
            found, _ = self.store.list_models(self.store.keys.segments(collection_id), SegmentInfo)
            for decoded in found:
                seg = decoded.model
                if seg.level is SegmentLevel.L0 or seg.state not in (
                    SegmentState.GROWING,
                    SegmentState.SEALED,
                ):
                    continue
                self.update_segment(decoded.kv.key, partial(segment_ops.mark_flushing, flush_ts=flush_ts))
            log.info("flush of collection %d at ts %d", collection_id, flush_ts)
            return flush_ts

    def _next_seal_ts(self) -> int:
        return max(self.tso.now(), self._max_assigned_ts + 1)

    def _seal_locked(
        self, chosen: Iterable[tuple[SegmentAllocation, str]], state: SegmentState
    ) -> list[SealedSegment]:
        chosen = list(chosen)
        seal_ts = self._next_seal_ts()
        sealed = []
        for seg, reason in chosen:
            key = (seg.collection_id, seg.partition_id, seg.vchannel)
            self._growing[key] = [s for s in self._growing.get(key, []) if s.segment_id != seg.segment_id]
            if not self._growing[key]:
                del self._growing[key]
            meta_key = self.store.keys.segment(*key[:2], seg.segment_id)
            self.update_segment(meta_key, partial(segment_ops.seal, seal_ts=seal_ts, state=state))
            sealed.append(
                SealedSegment(
                    seg.segment_id, seg.collection_id, seg.partition_id, seg.vchannel, seal_ts, reason
                )
            )
            log.info("sealed segment %d on %s at ts %d: %s", seg.segment_id, seg.vchannel, seal_ts, reason)
        return sealed

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
        segments, _ = self.store.list_models(self.store.keys.segments(collection_id), SegmentInfo)
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
        found, _ = self.store.list_models(self.store.keys.segments(), SegmentInfo, skip_malformed=True)
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

    # --- drops and reload ----------------------------------------------------------------

    def drop_collection(self, collection_id: int) -> list[int]:
        """Mark every segment of a dropped collection Dropped (its files go to GC)."""
        return self._drop(collection_id, None)

    def drop_partition(self, collection_id: int, partition_id: int) -> list[int]:
        """Mark every segment of a dropped partition Dropped (its files go to GC)."""
        return self._drop(collection_id, partition_id)

    def _drop(self, collection_id: int, partition_id: int | None) -> list[int]:
        with self._lock:
            for key in [k for k in self._growing if k[0] == collection_id]:
                if partition_id is None or key[1] == partition_id:
                    del self._growing[key]
            if partition_id is None:
                self._max_rows.pop(collection_id, None)
            found, _ = self.store.list_models(self.store.keys.segments(collection_id), SegmentInfo)
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

    def reload(self) -> None:
        """Rebuild the growing allocations from etcd (at start, or to pick up changes).
        Rows handed out but not yet synced are unknown: `num_rows` is the floor."""
        found, _ = self.store.list_models(self.store.keys.segments(), SegmentInfo, skip_malformed=True)
        growing: dict[tuple[int, int, str], list[SegmentAllocation]] = {}
        max_ts = 0
        for decoded in found:
            seg = decoded.model
            if seg.dml_position is not None:
                max_ts = max(max_ts, seg.dml_position.timestamp)
            if seg.state is not SegmentState.GROWING or seg.level is SegmentLevel.L0:
                continue
            last_insert = max(seg.last_insert_at, seg.created_at)
            if seg.dml_position is not None:
                last_insert = max(last_insert, physical_ms(seg.dml_position.timestamp) / 1000)
            max_rows = seg.max_rows or self.max_rows(seg.collection_id)
            allocation = SegmentAllocation(
                seg.id,
                seg.collection_id,
                seg.partition_id,
                seg.vchannel,
                max_rows,
                seg.num_rows,
                seg.created_at,
                last_insert,
                seg.dml_position.timestamp if seg.dml_position else 0,
            )
            growing.setdefault((seg.collection_id, seg.partition_id, seg.vchannel), []).append(allocation)
        with self._lock:
            self._growing = growing
            self._max_assigned_ts = max(self._max_assigned_ts, max_ts)

    # --- compare-and-swap ----------------------------------------------------------------

    def update_segment(self, key: str, change: Callable[[SegmentInfo], SegmentInfo | None]) -> SegmentInfo:
        """Read-modify-write of one SegmentInfo with CAS on the version read; re-read and
        retry when the DataNode (or anyone) changed it meanwhile. `change` returns None
        when nothing needs to be written."""

        def attempt() -> SegmentInfo:
            found = self.store.get_model(key, SegmentInfo)
            if found is None:
                raise SegmentNotFoundError(key)
            new = change(found.model)
            if new is None or new == found.model:
                return found.model
            self.store.cas(key, found.kv.version, new)
            return new

        return retry_on_conflict(f"segment {key}", attempt, on_conflict=self._count_conflict)

    def _count_conflict(self, exc: CasConflictError) -> None:
        self.cas_retries += 1
