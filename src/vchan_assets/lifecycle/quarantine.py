"""Getting a flushed segment past a damaged binlog (`vchan quarantine --file PATH` given an
`insert_log/...` path); the log's side is `wal.quarantine`.

A segment's rows are cut into binlog files, one per sync (and per compaction output part),
aligned across its column groups: file i of every group holds the same rows, and stats log
i their pk stats. A damaged file loses those rows only. In this order, so a crash leaves the
loss recorded, never a silent hole:

1. the loss is recorded in etcd (`DataLoss` kind "binlog": segment, rows, file, why);
2. the segment meta drops file i of every column group and its stats log, its row count
   less those rows, in one compare-and-swap on its version (a segment changed meanwhile,
   by a compaction say, fails with CasConflictError: look again);
3. the `then` steps run with the segment as it is now (`vchan quarantine`:
   `indexes.tasks.rebuild_segment`, which resets the segment's index builds, made over the
   old rows, and queues their rebuild: a search meanwhile searches the segment exactly);
4. the damaged file moves to `quarantine/{its key}`; the same rows' files of the other
   groups are left to garbage collection (no meta names them any more).

The segment's other files are kept: its remaining rows read as before. A crash between 2
and 3 leaves an index over more rows than the segment holds: a search finds the counts
differ, searches the segment exactly and queues the rebuild itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pyarrow as pa

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import Decoded
from vchan_assets.model import CollectionInfo, DataLoss, SegmentInfo, SegmentState
from vchan_assets.storage.layout import segment_of
from vchan_assets.system import System
from vchan_assets.wal.quarantine import (
    QUARANTINE_PREFIX,
    NotDamagedError,
    key_of,
    move_to_quarantine,
    record_loss,
)


@dataclass(frozen=True)
class DamagedBinlog:
    """What quarantining a damaged binlog would do: for the confirmation prompt."""

    key: str
    path: str
    collection: CollectionInfo
    segment: Decoded[SegmentInfo]
    index: int  # its position in its column group: the same in every group
    rows: int
    reason: str

    def describe(self) -> str:
        seg = self.segment.model
        return (
            f"{self.path}: {self.reason}\n"
            f"quarantining it loses {self.rows} of the {seg.num_rows} rows of segment {seg.id} "
            f"(collection {self.collection.name}); its other binlog files are kept; the loss is "
            "recorded in etcd for good"
        )


def is_binlog(system: System, path: str) -> bool:
    return segment_of(key_of(system.storage, path)) is not None


def inspect_binlog(system: System, path: str) -> DamagedBinlog:
    """The damaged binlog at `path` and the rows its loss would take; NotDamagedError if no
    live Flushed segment names it or it reads."""
    storage, store = system.storage, system.store
    key = key_of(storage, path)
    ids = segment_of(key)
    if ids is None:
        raise NotDamagedError(path, "not a binlog (insert_log/{collection}/{partition}/{segment}/...)")
    found = store.get_model(store.keys.segment(*ids), SegmentInfo)
    if found is None or found.model.state is not SegmentState.FLUSHED:
        raise NotDamagedError(storage.path(key), f"no Flushed segment {ids[2]} names it")
    seg = found.model
    where = [(g, i) for g in seg.binlogs for i, b in enumerate(g.logs) if b.path == key]
    if not where:
        raise NotDamagedError(storage.path(key), f"segment {seg.id} does not name it (a delta or stats log?)")
    group, index = where[0]
    try:
        rows = storage.read_parquet(key).num_rows
    except (pa.ArrowException, OSError) as exc:
        reason = f"unreadable: {exc}"
    else:
        raise NotDamagedError(storage.path(key), f"it reads ({rows} rows)")
    lost = group.logs[index].entries
    info = CollectionRegistry(store).get(seg.collection_id, include_dropped=True)
    return DamagedBinlog(key, storage.path(key), info, found, index, lost, reason)


def quarantine_binlog(
    system: System,
    damaged: DamagedBinlog,
    then: Sequence[Callable[[System, SegmentInfo, str], object]] = (),
) -> DataLoss:
    """Record the loss, take the rows' files out of the segment meta, run the `then` steps
    (segment, reason), move the file aside."""
    store, storage = system.store, system.storage
    seg = damaged.segment.model
    loss = DataLoss(
        loss_id=IdAllocator(store).alloc(),
        collection_id=seg.collection_id,
        kind="binlog",
        path=damaged.path,
        moved_to=storage.path(QUARANTINE_PREFIX + damaged.key),
        reason=damaged.reason,
        vchannel=seg.vchannel,
        at=time.time(),
        segment_id=seg.id,
        rows=damaged.rows,
    )
    record_loss(system, loss)
    i = damaged.index
    groups = tuple(replace(g, logs=g.logs[:i] + g.logs[i + 1 :]) for g in seg.binlogs)
    aligned = len(seg.statslogs) == len(seg.binlogs[0].logs)
    stats = seg.statslogs[:i] + seg.statslogs[i + 1 :] if aligned else seg.statslogs
    kept = seg.with_changes(binlogs=groups, statslogs=stats, num_rows=seg.num_rows - damaged.rows)
    store.cas(damaged.segment.kv.key, damaged.segment.kv.version, kept)
    reason = f"binlog {damaged.path} quarantined: {damaged.rows} rows lost (loss {loss.loss_id})"
    for step in then:
        step(system, kept, reason)
    move_to_quarantine(storage, damaged.key)
    return loss
