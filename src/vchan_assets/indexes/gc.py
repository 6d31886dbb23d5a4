"""Garbage collection of index builds and files, a pass of the GC
(`lifecycle.gc.GarbageCollector(passes=[collect_indexes])`, run by the DataCoord and
`vchan gc`). In this order:

  1. builds of a dropped index (or one gone): their files, then their record; the dropped
     index's record once it has no builds left;
  2. builds of a segment whose meta is gone (GC deleted it after the drop tolerance, time
     travel and read pins let it, and its output stopped waiting for its index): files,
     then record. A compaction's input waits until every live segment made from it
     (`compaction_from`) has its build of the same index Finished, or was stamped ready
     without it (`ready_ts`: its build Failed for good or took too long), so a search never
     loses the inputs' index before their output has one;
  3. files under `index_files/` of a build no record names (its record deleted, a crash
     between the two) and files of a version other than its record's (a build started
     again: the older builder's files are never committed), once older than
     VCHAN_GC_MISSING_TOLERANCE (a build writes its files before its commit).

A build of a Dropped segment whose meta remains stays: a read at a time within the time
travel window may still search that segment. Files go before records: a crash between
leaves a record naming missing files (a search falls back to exact) that the next pass
finishes.
"""

from __future__ import annotations

from vchan_assets.indexes.meta import list_builds, list_indexes
from vchan_assets.lifecycle.gc import GarbageCollector, GcReport
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.model import SegmentIndex, SegmentIndexState, SegmentState
from vchan_assets.storage.layout import INDEX_FILES


def collect_indexes(gc: GarbageCollector, report: GcReport) -> None:
    store, storage = gc.store, gc.storage
    indexes = {d.model.index_id: d for d in list_indexes(store, include_deleted=True)}
    # Dropped segments included: their builds stay while GC keeps them (a read at a past
    # timestamp, or the query view serving compaction inputs, searches them).
    found = SegmentMeta(store).list(include_dropped=True)
    segments = {d.model.id: d.model for d in found}
    builds = list_builds(store)
    finished = {
        (b.model.index_id, b.model.segment_id) for b in builds if b.model.state is SegmentIndexState.FINISHED
    }
    children: dict[int, list[int]] = {}  # input segment -> live segments made from it, not ready
    for seg in segments.values():
        if seg.state is not SegmentState.DROPPED and not seg.ready_ts:
            for parent in seg.compaction_from:
                children.setdefault(parent, []).append(seg.id)
    files: dict[int, list[tuple[str, int, int, float]]] = {}  # build -> (key, version, size, mtime)
    for info in storage.list_files(INDEX_FILES + "/"):
        key = storage.key_of(info.path)
        parts = key.split("/")
        if len(parts) < 4 or not parts[1].isdigit() or not parts[2].isdigit():
            continue
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        files.setdefault(int(parts[1]), []).append((key, int(parts[2]), int(info.size or 0), mtime))

    def drop(b: SegmentIndex, kv_key: str, version: int) -> bool:
        for key, _, size, _ in files.pop(b.build_id, []):
            gc.delete(key, size, report, report.index_files)
        if not report.dry_run:
            try:
                store.cas(kv_key, version, None)
            except CasConflictError:
                return False  # changed meanwhile: the next pass looks again
        report.index_builds.append(b.build_id)
        return True

    kept: dict[int, int] = {}  # build -> its record's version
    with_builds: set[int] = set()  # indexes with a build left
    for d in builds:
        b = d.model
        index = indexes.get(b.index_id)
        gone = index is None or index.model.deleted
        orphaned = b.segment_id not in segments and not _waits_for_children(
            b, children.get(b.segment_id, []), finished
        )
        if (gone or orphaned) and drop(b, d.kv.key, d.kv.version):
            continue
        kept[b.build_id] = b.version
        with_builds.add(b.index_id)
    for fi in indexes.values():  # a dropped index without builds left: its record goes
        if fi.model.deleted and fi.model.index_id not in with_builds and not report.dry_run:
            try:
                store.cas(fi.kv.key, fi.kv.version, None)
            except CasConflictError:
                continue
    oldest = gc.clock() - gc.settings.gc_missing_tolerance
    for build_id, held in files.items():
        current = kept.get(build_id)
        for key, version, size, mtime in held:
            if version != current and mtime <= oldest:
                gc.delete(key, size, report, report.index_files)


def _waits_for_children(b: SegmentIndex, children: list[int], finished: set[tuple[int, int]]) -> bool:
    return any((b.index_id, child) not in finished for child in children)
