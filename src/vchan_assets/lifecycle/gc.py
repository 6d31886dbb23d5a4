"""Garbage collection of binlogs, dropped segments and the log (Milvus' DataCoord
garbage collector: interval, missing tolerance, drop tolerance, pause/resume).

One pass, in this order:
  1. orphans: binlog files no segment meta names (a sync or compaction that crashed or
     lost its commit) once older than the missing tolerance; files of segments an active
     compaction plan or an unfinished import job reserved are left alone (a large import
     registers its segments over several transactions, maybe after a restart), and so is
     any file younger than the tolerance (a sync in flight writes files before their meta);
  2. Dropped segments, once dropped longer than the drop tolerance AND once the channel
     checkpoint is past their dml_position (a replay from an older checkpoint would need
     the meta to skip their rows) AND once no compaction output made from them waits for
     its index (`model.awaited_indexes` without a `ready_ts`: the query view serves its
     inputs meanwhile), nor became ready within the time-travel window: files first, then meta (a crash between the two leaves a Dropped
     meta naming missing files, which the next pass finishes);
  3. log retention: a vchannel's log files wholly below its checkpoint and older than the
     retention, each with its data file (log format 2); the file holding the checkpoint
     and the newest file always stay. A data file no log file names once older than the
     retention (its producer died before publishing the batch; a live producer publishes
     within its lock wait and retry timeout, far below the retention) goes too. A file
     holding an offset after what a registered change stream has committed stays while
     that stream was seen within VCHAN_STREAM_IDLE_TIMEOUT (`datacoord.streams`).
  4. the passes plugged in from above (`indexes.gc.collect_indexes`: builds and index
     files), given this collector and the report.
Never deleted: a file named by the meta of a segment that is not Dropped.
Failpoint: gc_after_files (a Dropped segment's files deleted, its meta not yet).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.read_pins import is_pinned, pinned_horizons
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.datacoord.streams import retention_holds
from vchan_assets.failpoints import failpoint
from vchan_assets.lifecycle.plans import busy_segments, list_plans
from vchan_assets.meta.codec import decode_dict
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import FieldIndex, SegmentInfo, SegmentState, awaited_indexes, physical_ms
from vchan_assets.storage.layout import BINLOG_ROOTS, segment_of
from vchan_assets.system import System
from vchan_assets.wal.format import data_prefix, wal_prefix
from vchan_assets.wal.reader import WalReader

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    paused_until: float = 0.0  # > now: the pass did nothing
    orphans: list[str] = field(default_factory=list)
    dropped_segments: list[int] = field(default_factory=list)
    segment_files: list[str] = field(default_factory=list)
    wal_files: list[str] = field(default_factory=list)
    index_builds: list[int] = field(default_factory=list)  # segment builds deleted
    index_files: list[str] = field(default_factory=list)
    bytes: int = 0
    dry_run: bool = False

    @property
    def files(self) -> int:
        return len(self.orphans) + len(self.segment_files) + len(self.wal_files) + len(self.index_files)


def dropped_since(seg: SegmentInfo) -> float:
    """When the segment was dropped; older records lack it: their last flush or creation."""
    if seg.dropped_at:
        return seg.dropped_at
    return max(seg.created_at, physical_ms(seg.last_flush_ts) / 1000.0)


def import_reserved(store: MetaStore) -> set[int]:
    """The segment ids unfinished import jobs reserved (Milvus' importMeta): their files are
    written before their meta. Read as plain records: the import layer sits above this one."""
    out: set[int] = set()
    for kv in store.list_prefix(store.keys.import_job.prefix).items:
        job = decode_dict(kv.key, kv.value)
        if job.get("state") not in ("Completed", "Failed"):
            out.update(int(i) for i in job.get("segment_ids", ()))
    return out


GcPass = Callable[["GarbageCollector", GcReport], None]


class GarbageCollector:
    def __init__(
        self, system: System, clock: Callable[[], float] = time.time, passes: Sequence[GcPass] = ()
    ) -> None:
        self.store, self.storage, self.settings = system.store, system.storage, system.settings
        self.clock = clock
        self.passes = tuple(passes)

    # --- pause / resume (Milvus' garbage_collection/pause, /resume) ----------------------

    def pause(self, seconds: float) -> float:
        until = self.clock() + seconds
        self.store.put(self.store.keys.gc_pause(), {"until": until})
        return until

    def resume(self) -> None:
        self.store.delete(self.store.keys.gc_pause())

    def paused_until(self) -> float:
        found = self.store.get(self.store.keys.gc_pause())
        if found is None:
            return 0.0
        until = decode_dict(found.key, found.value).get("until", 0.0)
        return float(until) if until > self.clock() else 0.0

    def due(self) -> bool:
        """The interval has passed since the last pass (any process's)."""
        found = self.store.get(self.store.keys.gc_last_run())
        if found is None:
            return True
        return (
            self.clock() - float(decode_dict(found.key, found.value).get("at", 0.0))
            >= self.settings.gc_interval
        )

    # --- one pass -----------------------------------------------------------------------

    def run(self, dry_run: bool = False) -> GcReport:
        report = GcReport(dry_run=dry_run)
        report.paused_until = self.paused_until()
        if report.paused_until:
            log.info("garbage collection paused until %.0f", report.paused_until)
            return report
        # Meta is read before files are listed: a file written after this read is younger
        # than the tolerance, so it is never taken for an orphan.
        found = self._segments(dry_run)
        busy = busy_segments(list_plans(self.store)) | import_reserved(self.store)
        self._orphans(found, busy, report)
        self._dropped(found, report)
        self._wal(report)
        for extra in self.passes:
            extra(self, report)
        if not dry_run:
            self.store.put(self.store.keys.gc_last_run(), {"at": self.clock()})
        log.info(
            "gc%s: %d orphans, %d dropped segments (%d files), %d log files, %d index builds (%d files), %.1f MB",
            " (dry run)" if dry_run else "",
            len(report.orphans),
            len(report.dropped_segments),
            len(report.segment_files),
            len(report.wal_files),
            len(report.index_builds),
            len(report.index_files),
            report.bytes / 1e6,
        )
        return report

    def _segments(self, dry_run: bool) -> list[Decoded[SegmentInfo]]:
        """Every segment, the Dropped ones of both families included (GC deletes their
        files, then their records, after the tolerance). The Dropped ones an older version
        left in the live family are first moved to the dropped family (not in a dry run)."""
        door = SegmentMeta(self.store)
        found = door.list(include_dropped=True)
        if not dry_run and door.move_dropped(found):
            found = door.list(include_dropped=True)
        return found

    def _orphans(self, found: list[Decoded[SegmentInfo]], busy: set[int], report: GcReport) -> None:
        named: set[str] | None = None  # every file meta names (gathered at the first file listed)
        oldest = self.clock() - self.settings.gc_missing_tolerance
        for root in BINLOG_ROOTS:
            for info in self.storage.list_files(root + "/"):
                if named is None:
                    named = {p for d in found for p in d.model.file_paths}
                key = self.storage.key_of(info.path)
                owner = segment_of(key)
                if key in named or (owner and owner[2] in busy):
                    continue
                if info.mtime is None or info.mtime.timestamp() > oldest:
                    continue
                self.delete(key, int(info.size or 0), report, report.orphans)

    def _dropped(self, found: list[Decoded[SegmentInfo]], report: GcReport) -> None:
        # A read at a timestamp within the time-travel window may serve a dropped segment
        # again (query.asof.segments_at): its files stay at least that long.
        oldest = self.clock() - max(self.settings.gc_drop_tolerance, self.settings.time_travel)
        due = [d for d in found if d.model.state is SegmentState.DROPPED and dropped_since(d.model) <= oldest]
        if not due:
            return
        live = {p for d in found if d.model.state is not SegmentState.DROPPED for p in d.model.file_paths}
        pins = pinned_horizons(self.store)  # running reads may open these
        held = self._inputs_served(found, oldest)
        for d in due:
            seg = d.model
            if is_pinned(seg, pins):
                continue
            if seg.id in held:
                continue
            if not self._checkpoint_past(seg):
                continue
            sizes = {b.path: b.size_bytes for b in (*seg.binlog_files, *seg.deltalogs, *seg.statslogs)}
            for path in seg.file_paths:
                if path not in live:
                    self.delete(path, sizes[path], report, report.segment_files)
            failpoint("gc_after_files")
            if not report.dry_run:
                try:
                    SegmentMeta(self.store).delete(d)  # (a live key with its vchannel's index entry)
                except CasConflictError:
                    continue  # changed meanwhile: the next pass looks again
            report.dropped_segments.append(seg.id)

    def _inputs_served(self, found: list[Decoded[SegmentInfo]], oldest: float) -> set[int]:
        """The visible inputs of compaction outputs (kept in meta) that wait for their index,
        or became ready after `oldest` (a read at a time before their `ready_ts`, within
        the time-travel window, serves the inputs): the query view serves these inputs in
        their place."""
        outputs = [d.model for d in found if d.model.compaction_from]
        if not outputs:
            return set()
        listed, _ = self.store.list_models(
            self.store.keys.field_index.prefix, FieldIndex, skip_malformed=True
        )
        indexes = [d.model for d in listed]
        by_id = {d.model.id: d.model for d in found}

        def holds(seg: SegmentInfo) -> bool:
            if seg.ready_ts:
                return physical_ms(seg.ready_ts) / 1000.0 > oldest
            return bool(awaited_indexes(seg, indexes))

        return {
            p
            for seg in outputs
            if holds(seg)
            for p in seg.compaction_from
            if p in by_id and not by_id[p].is_invisible
        }

    def _checkpoint_past(self, seg: SegmentInfo) -> bool:
        if seg.dml_position is None:
            return True
        cp = channel_checkpoint(self.store, seg.vchannel)
        return cp is not None and cp.model.offset >= seg.dml_position.offset

    def _wal(self, report: GcReport) -> None:
        oldest = self.clock() - self.settings.wal_retention
        holds = retention_holds(self.store, self.clock(), self.settings.stream_idle_timeout)
        for info in CollectionRegistry(self.store).list(include_dropped=True):
            for vchannel in info.vchannels:
                cp = channel_checkpoint(self.store, vchannel)
                if cp is None:
                    continue
                # A file is kept if it holds the checkpoint or an offset a stream has yet to read.
                keep_from = min(cp.model.offset, holds.get(vchannel, cp.model.offset) + 1)
                files = WalReader(self.storage, vchannel, info).files()
                mtimes = {
                    self.storage.key_of(i.path): i.mtime
                    for i in self.storage.list_files(wal_prefix(vchannel))
                }
                for f in files[:-1]:  # the newest file stays: the writer continues from it
                    mtime = mtimes.get(f.key)
                    if f.last_offset >= keep_from or mtime is None or mtime.timestamp() > oldest:
                        continue
                    self.delete(f.key, f.size_bytes - f.data_bytes, report, report.wal_files)
                    if f.data_key:  # after its log file: a crash between leaves an orphan, not a hole
                        self.delete(f.data_key, f.data_bytes, report, report.wal_files)
                named = {f.data_key for f in files}
                for i in self.storage.list_files(data_prefix(vchannel)):
                    key = self.storage.key_of(i.path)
                    if key not in named and i.mtime is not None and i.mtime.timestamp() <= oldest:
                        self.delete(key, i.size or 0, report, report.wal_files)

    def delete(self, key: str, size: int, report: GcReport, into: list[str]) -> None:
        """Delete one file (not in a dry run), counted in `report` and listed in `into`."""
        if not report.dry_run:
            self.storage.delete(key)
        into.append(key)
        report.bytes += size
