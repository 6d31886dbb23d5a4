"""The sync task (DataNode role): a log range -> binlogs -> segment meta -> checkpoint.

Commit order (invariant 1 of docs/architecture.md; "segment meta BEFORE channel checkpoint"
in the lease design of Milvus' "DataNode removes its dependency on DataCoord"):
  0. the claim: `channel-sync/{vchannel}` rewritten (guarded by the lease), the state read
     as of after it; every later transaction compares its version, so of two syncs of
     one channel under one lease (a run given up on while its worker still ran, and the
     next one) the earlier fails with SyncSupersededError and commits nothing more
     (a sync with nothing to commit claims nothing);
  1. binlog, delta and stats files, written by the tasks to fresh unique paths;
  2. segment meta (binlogs appended, rows, start/dml positions, Flushed), in
     transactions guarded by the channel lease and by each segment's version;
  3. the channel checkpoint, guarded the same way, only forward.
A crash between any two steps loses nothing: the next sync replays from the old
checkpoint and drops rows at or below each segment's dml_position; files that no
meta points to are orphans for GC. A lost lease rejects the commit whole
(LeaseLostError) and the channel's work stops.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.datacoord import segment_ops
from vchan_assets.datacoord.collections import VchannelNotFoundError
from vchan_assets.datacoord.recovery import channel_checkpoint, channel_segments
from vchan_assets.datanode.binlog_writer import (
    DELTA,
    INSERT,
    RESULT_SCHEMA,
    SCALAR_GROUP,
    STATS,
    TaskSpec,
    WrittenFile,
    from_record,
    group_field_ids,
    run_tasks,
    run_tasks_arrow,
    run_tasks_in_process,
    written_or_raise,
)
from vchan_assets.datanode.channel_state import ChannelState, read_channel_state
from vchan_assets.failpoints import failpoint
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.errors import CasConflictError, CheckpointRegressionError, SyncSupersededError
from vchan_assets.meta.retry import retry_on_conflict
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, Value
from vchan_assets.model import (
    Binlog,
    ChannelLease,
    CollectionInfo,
    ColumnGroupBinlogs,
    MsgPosition,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    SyncClaim,
)
from vchan_assets.spark import Engine
from vchan_assets.system import System
from vchan_assets.wal.reader import WalFile, WalReader

log = logging.getLogger(__name__)

# etcd allows 128 operations per transaction by default: a segment is 1 put, 2 when the
# sync creates it (its meta and its vchannel's index entry, `SegmentMeta.create_puts`), 3
# when the flush finds it empty and drops it (moved to the dropped family, `SegmentMeta.writes`).
SEGMENTS_PER_TXN = 40
COMMIT_ATTEMPTS = 20
IDS_PER_TASK = 100_000


@dataclass(frozen=True)
class SyncPhases:
    state: float
    binlogs: float
    commit: float

    @property
    def total(self) -> float:
        return self.state + self.binlogs + self.commit

    def __str__(self) -> str:
        return f"state {self.state:.2f}s, binlogs {self.binlogs:.2f}s, commit {self.commit:.2f}s"


@dataclass(frozen=True)
class SyncResult:
    vchannel: str
    start: MsgPosition  # checkpoint before
    end: MsgPosition  # checkpoint after (== start when nothing was synced)
    rows: int = 0
    deletes: int = 0
    files: int = 0
    bytes: int = 0
    segments: tuple[int, ...] = ()
    flushed_segments: tuple[int, ...] = ()
    skipped: str = ""  # why nothing was done
    in_process: bool = False  # the binlogs were written in this process, not by a Spark job
    # Where the seconds went: reading the channel's state under the claim, writing the
    # binlogs (the Spark job or the in-process tasks), committing segments and checkpoint.
    phases: SyncPhases | None = None  # None: nothing was synced

    @property
    def seconds(self) -> float:
        return self.phases.total if self.phases else 0.0

    @property
    def synced(self) -> bool:
        return not self.skipped

    @property
    def written_by(self) -> str:
        """Where the binlogs were written (`VCHAN_SYNC_IN_PROCESS_MB` decides)."""
        return "DataNode process" if self.in_process else "Spark job"


@dataclass
class _SegmentUpdate:
    """What this sync adds to one segment; applied to whatever version is in etcd."""

    segment_id: int
    partition_id: int
    level: SegmentLevel = SegmentLevel.L1
    binlogs: dict[int, list[Binlog]] = field(default_factory=lambda: defaultdict(list))
    deltalogs: list[Binlog] = field(default_factory=list)
    statslogs: list[Binlog] = field(default_factory=list)
    rows: int = 0
    first: MsgPosition | None = None

    def apply(
        self, seg: SegmentInfo, end: MsgPosition, group_fields: dict[int, tuple[int, ...]]
    ) -> SegmentInfo:
        groups = {g.group: g for g in seg.binlogs}
        for group, logs in self.binlogs.items():
            old = groups.get(group)
            groups[group] = ColumnGroupBinlogs(
                group, group_fields.get(group, ()), (*(old.logs if old else ()), *logs)
            )
        return seg.with_changes(
            binlogs=tuple(groups[g] for g in sorted(groups)),
            deltalogs=(*seg.deltalogs, *self.deltalogs),
            statslogs=(*seg.statslogs, *self.statslogs),
            num_rows=seg.num_rows + self.rows,
            start_position=seg.start_position or self.first,
            dml_position=end,
            last_flush_ts=end.timestamp,
        )


class SyncTask:
    """Sync one vchannel from its checkpoint to its latest time tick, under `lease`."""

    def __init__(
        self,
        system: System,
        collection: CollectionInfo,
        vchannel: str,
        lease: ChannelLease,
        engine: Engine = "spark",
        job_timeout: float = 600.0,
    ) -> None:
        if vchannel not in collection.vchannels:
            raise VchannelNotFoundError(vchannel, collection.name)
        self.system = system
        self.store, self.storage, self.settings = system.store, system.storage, system.settings
        self.collection = collection
        self.vchannel = vchannel
        self.lease = lease
        self.engine = engine
        self.job_timeout = job_timeout
        self.ids = IdAllocator(system.store)
        self.reader = WalReader(system.storage, vchannel, collection)
        self._claimed: dict[str, int] = {}  # the claim key and the version this sync left it at

    # --- public -------------------------------------------------------------------

    def run(self) -> SyncResult:
        started = time.monotonic()
        state = self._claimed_state()
        cp, start, end = state.committed, state.checkpoint, state.head
        segments = {d.model.id: d for d in state.segments}
        if end is None or end.offset <= start.offset:
            # Nothing new in the log; sealed segments may still be ready to flush.
            flushed = self._commit_segments({}, segments, start) if end else ()
            return SyncResult(
                self.vchannel, start, start, flushed_segments=flushed, skipped="no new time tick"
            )
        if end.timestamp < start.timestamp:
            raise CheckpointRegressionError(self.vchannel, start, end)

        files = [f for f in state.unsynced_files if f.overlaps(start.offset, end.offset)]
        in_process = self._in_process(files)
        read = time.monotonic()
        written = self._write_binlogs(files, start, end, segments, in_process)
        failpoint("after_binlogs")
        wrote = time.monotonic()
        updates = self._updates(written)
        flushed = self._commit_segments(updates, segments, end)
        failpoint("before_checkpoint")
        self._commit_checkpoint(cp, end)
        done = time.monotonic()
        result = SyncResult(
            self.vchannel,
            start,
            end,
            rows=sum(w.entries for w in written if w.kind == INSERT and w.group == SCALAR_GROUP),
            deletes=sum(w.entries for w in written if w.kind == DELTA),
            files=len(written),
            bytes=sum(w.size_bytes for w in written),
            segments=tuple(sorted(updates)),
            flushed_segments=flushed,
            in_process=in_process,
            phases=SyncPhases(read - started, wrote - read, done - wrote),
        )
        log.info(
            "synced %s (%d, %d]: %d rows, %d deletes, %d files, %.1f MB in %.2fs (%s; %s)",
            self.vchannel,
            start.offset,
            end.offset,
            result.rows,
            result.deletes,
            result.files,
            result.bytes / 1e6,
            result.seconds,
            result.written_by,
            result.phases,
        )
        return result

    # --- step 0: the claim ---------------------------------------------------------

    def _claimed_state(self) -> ChannelState:
        """The channel's state as of after this sync's claim. A sync with nothing to
        commit (no new time tick, no sealed segment to finish) claims nothing and writes
        nothing. Otherwise the claim comes first, and the state is read again if a sync
        committed between the first read and the claim (its checkpoint or segment
        versions moved), so this sync starts after whatever that one committed."""
        state = read_channel_state(self.store, self.reader)
        if not (state.has_unsynced or state.ready_to_flush):
            return state
        self._claim()
        cp = channel_checkpoint(self.store, self.vchannel)
        now = _versions(cp, channel_segments(self.store, self.collection.id, self.vchannel))
        if now != _versions(state.committed, state.segments):
            state = read_channel_state(self.store, self.reader)
        return state

    def _claim(self) -> None:
        """Claim the channel for this sync (see SyncClaim)."""
        key = self.store.keys.channel_sync(self.vchannel)
        claim = SyncClaim(self.lease.lease_id, socket.gethostname(), os.getpid(), time.time())

        def attempt() -> int:
            found = self.store.get(key)
            version = found.version if found else 0
            self.store.guarded_txn(self.vchannel, self.lease, {key: claim}, expect_versions={key: version})
            return version + 1

        self._claimed = {key: retry_on_conflict(f"sync claim of {self.vchannel}", attempt)}

    def _guarded(self, puts: dict[str, Any], expect: dict[str, int], deletes: Sequence[str] = ()) -> None:
        """One transaction under the lease and this sync's claim, expecting `expect`."""
        try:
            self.store.guarded_txn(
                self.vchannel, self.lease, puts, deletes, expect_versions={**self._claimed, **expect}
            )
        except CasConflictError as exc:
            if exc.key in self._claimed:
                raise SyncSupersededError(self.vchannel) from exc
            raise

    # --- step 1: files --------------------------------------------------------------

    def _in_process(self, files: list[WalFile]) -> bool:
        """Whether this sync's tasks run here rather than as a Spark job: always for the
        local engine; for Spark when the log range is at most `sync_in_process_mb` (0:
        never), because a Spark job costs a tenth of a second or more however few rows it
        writes (BENCHMARKS.md, "Sync")."""
        if self.engine == "local":
            return True
        limit = self.settings.sync_in_process_mb * 2**20
        return limit > 0 and sum(f.size_bytes for f in files) <= limit

    def _write_binlogs(
        self,
        files: list[WalFile],
        start: MsgPosition,
        end: MsgPosition,
        segments: dict[int, Decoded[SegmentInfo]],
        in_process: bool,
    ) -> list[WrittenFile]:
        chunks = split_by_size(files, self.settings.spark_partitions)
        n_tasks = len(chunks)
        insert_floor = {
            sid: floor for sid, d in segments.items() if (floor := _insert_floor(d.model, end)) >= 0
        }
        delete_floor: dict[int, int] = {}
        for d in segments.values():
            if d.model.level is SegmentLevel.L0 and d.model.dml_position:
                part = d.model.partition_id
                delete_floor[part] = max(delete_floor.get(part, -1), d.model.dml_position.offset)
        # Deletes of this sync go to a new L0 segment per partition (Milvus 2.4+).
        first_l0 = self.ids.alloc(len(self.collection.partitions))
        l0 = {p: first_l0 + i for i, p in enumerate(self.collection.partitions)}
        id_base = self.ids.alloc(IDS_PER_TASK * n_tasks)
        specs = [
            TaskSpec(
                task=i,
                storage=self.storage,
                collection_id=self.collection.id,
                vchannel=self.vchannel,
                schema=self.collection.schema.to_dict(),
                file_keys=tuple(f.key for f in chunk),
                after_offset=start.offset,
                up_to_offset=end.offset,
                insert_floor=insert_floor,
                delete_floor=delete_floor,
                l0_segments=l0,
                id_base=id_base + i * IDS_PER_TASK,
                id_count=IDS_PER_TASK,
            )
            for i, chunk in enumerate(chunks)
        ]
        if in_process:
            return run_tasks_in_process(specs)
        return _run_on_spark(self.settings, specs, self.job_timeout, self.vchannel, self.system.spark)

    # --- step 2: segment meta --------------------------------------------------------

    def _updates(self, written: list[WrittenFile]) -> dict[int, _SegmentUpdate]:
        updates: dict[int, _SegmentUpdate] = {}
        for w in sorted(written, key=lambda w: (w.segment_id, w.min_offset, w.group)):
            upd = updates.get(w.segment_id)
            if upd is None:
                level = SegmentLevel.L0 if w.kind == DELTA else SegmentLevel.L1
                upd = updates[w.segment_id] = _SegmentUpdate(w.segment_id, w.partition_id, level)
            binlog = Binlog(w.log_id, w.key, w.entries, w.ts_from, w.ts_to, w.size_bytes)
            first = MsgPosition(self.vchannel, w.min_offset, w.min_offset_ts)
            if upd.first is None or first.offset < upd.first.offset:
                upd.first = first
            if w.kind == INSERT:
                upd.binlogs[w.group].append(binlog)
                if w.group == SCALAR_GROUP:
                    upd.rows += w.entries
            elif w.kind == STATS:
                upd.statslogs.append(binlog)
            else:
                upd.deltalogs.append(binlog)
                upd.rows += w.entries
        return updates

    def _commit_segments(
        self, updates: dict[int, _SegmentUpdate], segments: dict[int, Decoded[SegmentInfo]], end: MsgPosition
    ) -> tuple[int, ...]:
        """Apply `updates` and flush sealed segments whose seal time the sync passed.
        Each transaction is guarded by the lease and by the versions it read; on a
        version conflict (the coordinator sealed a segment meanwhile) re-read and retry."""
        ready = {sid for sid, d in segments.items() if segment_ops.ready_to_flush(d.model, end)}
        todo = sorted(set(updates) | ready)
        group_fields = group_field_ids(self.collection.schema)
        flushed: list[int] = []
        for i in range(0, len(todo), SEGMENTS_PER_TXN):
            chunk = todo[i : i + SEGMENTS_PER_TXN]
            flushed += self._commit_chunk(chunk, updates, segments, end, group_fields)
            failpoint("after_segment_meta")
        return tuple(flushed)

    def _commit_chunk(
        self,
        chunk: list[int],
        updates: dict[int, _SegmentUpdate],
        segments: dict[int, Decoded[SegmentInfo]],
        end: MsgPosition,
        group_fields: dict[int, tuple[int, ...]],
    ) -> list[int]:
        door = SegmentMeta(self.store)

        def attempt() -> list[int]:
            puts: dict[str, Value] = {}
            deletes: list[str] = []
            expect: dict[str, int] = {}
            flushed = []
            for sid in chunk:
                current = segments.get(sid)
                upd = updates.get(sid)
                if current is None:  # created, unless it was dropped meanwhile (then retried)
                    assert upd is not None
                    seg = self._new_segment(upd)
                    expect.update(door.create_expect(seg))
                else:
                    seg = current.model
                    expect[current.kv.key] = current.kv.version
                if upd is not None:
                    seg = upd.apply(seg, end, group_fields)
                done = segment_ops.complete_flush(seg, end)
                if done is not None:
                    seg = done
                    flushed.append(sid)
                if current is None and seg.state is not SegmentState.DROPPED:
                    puts.update(door.create_puts(seg))  # its vchannel's index entry with it
                elif current is not None and door.is_dropped_key(current.kv.key):
                    puts[current.kv.key] = seg  # dropped after its rows were logged: files go with it
                else:
                    written, gone = door.writes(seg)  # an emptied one leaves the live family
                    puts.update(written)
                    deletes += gone
            self._guarded(puts, expect, deletes)
            return flushed

        def reread(exc: CasConflictError) -> None:  # the coordinator sealed a segment meanwhile
            fresh = {d.model.id: d for d in channel_segments(self.store, self.collection.id, self.vchannel)}
            segments.update({sid: fresh[sid] for sid in chunk if sid in fresh})

        return retry_on_conflict(
            f"segment meta of {self.vchannel}", attempt, attempts=COMMIT_ATTEMPTS, on_conflict=reread
        )

    def _new_segment(self, upd: _SegmentUpdate) -> SegmentInfo:
        # L0 segments hold this sync's deletes and are complete at once; an L1 segment
        # missing from meta (allocated but its meta lost) is recreated as Growing.
        return SegmentInfo(
            id=upd.segment_id,
            collection_id=self.collection.id,
            partition_id=upd.partition_id,
            vchannel=self.vchannel,
            state=SegmentState.FLUSHING if upd.level is SegmentLevel.L0 else SegmentState.GROWING,
            level=upd.level,
            created_at=time.time(),
        )

    # --- step 3: checkpoint -----------------------------------------------------------

    def _commit_checkpoint(self, before: Decoded[MsgPosition] | None, end: MsgPosition) -> None:
        """Checkpoints only move forward (invariant 4); the version read at the start
        guards against anyone else having moved it since."""
        if before and end.offset <= before.model.offset:
            raise CheckpointRegressionError(self.vchannel, before.model, end)
        key = self.store.keys.channel_checkpoint(self.vchannel)
        self._guarded({key: end}, {key: before.kv.version if before else 0})


def _versions(
    cp: Decoded[MsgPosition] | None, segments: Sequence[Decoded[SegmentInfo]]
) -> tuple[int, dict[int, int]]:
    return (cp.kv.version if cp else 0), {d.model.id: d.kv.version for d in segments}


def _insert_floor(seg: SegmentInfo, end: MsgPosition) -> int:
    """The offset at or below which replay leaves out the segment's inserts (-1: none).
    Replay filters by segment state, not only by offset (as Milvus' flowgraph drops the
    inserts of flushed and dropped segments): a Flushed segment holds all its rows, a
    Dropped one (its partition dropped, or compacted away) must get none."""
    if seg.level is SegmentLevel.L0:
        return -1
    if seg.state in (SegmentState.FLUSHED, SegmentState.DROPPED):
        return end.offset
    return seg.dml_position.offset if seg.dml_position else -1


def split_by_size(files: Sequence[WalFile], parts: int) -> list[list[WalFile]]:
    """At most `parts` runs of consecutive files with about the same number of bytes each:
    the sync takes as long as its largest task, and log files differ in size (a channel's
    first file holds one create_collection message). Each file goes to the task whose share
    of the bytes its middle falls in; a task left with no file is dropped."""
    if not files:
        return [[]]
    parts = max(1, min(parts, len(files)))
    total = sum(f.size_bytes for f in files) or 1
    chunks: list[list[WalFile]] = [[] for _ in range(parts)]
    done = 0
    for f in files:
        chunks[min(parts - 1, int((done + f.size_bytes / 2) * parts / total))].append(f)
        done += f.size_bytes
    return [c for c in chunks if c]


def _run_on_spark(
    settings: Settings, specs: list[TaskSpec], timeout: float, vchannel: str, spark: Any = None
) -> list[WrittenFile]:
    from vchan_assets.spark.session import get_spark, run_job, settings_is_connect

    spark = spark or get_spark(settings)
    if settings_is_connect(spark):
        return _run_on_connect(spark, specs, timeout, vchannel)
    # A classic session runs the tasks as an RDD job over their indices: no query plan,
    # no Python UDF and no Arrow round trip for a handful of task descriptions (about
    # 1.7x less fixed cost than the same job through mapInArrow: BENCHMARKS.md, "Sync").
    tasks = spark.sparkContext.parallelize(range(len(specs)), len(specs))
    job = tasks.mapPartitions(lambda indices: run_tasks(specs, indices))
    return written_or_raise(run_job(spark, f"sync {vchannel}", job.collect, timeout))


def _run_on_connect(spark: Any, specs: list[TaskSpec], timeout: float, vchannel: str) -> list[WrittenFile]:
    """Spark Connect has no RDDs: the same tasks through mapInArrow."""
    from vchan_assets.spark.session import run_arrow_tasks

    rows = run_arrow_tasks(spark, run_tasks_arrow, specs, RESULT_SCHEMA, f"sync {vchannel}", timeout)
    return [from_record(r.asDict()) for r in rows]
