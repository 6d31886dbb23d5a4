"""Every change of a segment's state, as a named operation in one place (the idea of
Milvus' `UpdateOperator`s in datacoord/meta.go).

An operation takes the SegmentInfo as etcd holds it and returns the changed one, or
None when the change no longer applies (someone moved the segment on meanwhile: keep
theirs). Callers apply operations inside a compare-and-swap retry, so an operation
always sees the latest version:

    Growing --seal--------> Sealed   --+
       |                               +--complete_flush--> Flushed + invisible (Dropped if empty)
       +-----mark_flushing-> Flushing -+                       |
    any but Dropped --drop--> Dropped                         sort commit (lifecycle): Dropped,
                                                              its sorted copy Flushed and visible

A flushed L1/L2 segment is written Flushed **and invisible** in that one update (Milvus'
postFlush, "hand-off growing segment after sorted"): readers serve it as growing until the
sort replaces it with its sorted copy. L0 segments (deletes only) are never invisible.
"""

from __future__ import annotations

import time

from vchan_assets.model import MsgPosition, SegmentInfo, SegmentLevel, SegmentState

# Sealed segments waiting for a sync to pass their seal timestamp.
SEALABLE = (SegmentState.SEALED, SegmentState.FLUSHING)


def seal(seg: SegmentInfo, seal_ts: int, state: SegmentState = SegmentState.SEALED) -> SegmentInfo | None:
    """Growing -> Sealed at `seal_ts`: no row after it belongs to the segment."""
    if seg.state is not SegmentState.GROWING:
        return None  # sealed, flushed or dropped by someone else meanwhile
    return seg.with_changes(state=state, seal_ts=seal_ts)


def mark_flushing(seg: SegmentInfo, flush_ts: int) -> SegmentInfo | None:
    """Growing or Sealed -> Flushing (a flush asked for it); a Sealed one keeps its
    earlier seal_ts, since no row after it belongs to the segment."""
    if seg.state is SegmentState.GROWING:
        return seg.with_changes(state=SegmentState.FLUSHING, seal_ts=flush_ts)
    if seg.state is SegmentState.SEALED:
        return seg.with_changes(state=SegmentState.FLUSHING, seal_ts=seg.seal_ts or flush_ts)
    return None


def drop(seg: SegmentInfo) -> SegmentInfo | None:
    """-> Dropped (its files go to garbage collection)."""
    if seg.state is SegmentState.DROPPED:
        return None
    return seg.with_changes(state=SegmentState.DROPPED, dropped_at=time.time())


def ready_to_flush(seg: SegmentInfo, position: MsgPosition) -> bool:
    """Every row of the segment is at or below `position`: an L0 segment (this sync's
    deletes) at once, a sealed L1 segment once `position` passed its seal_ts."""
    if seg.state not in SEALABLE:
        return False
    return seg.level is SegmentLevel.L0 or seg.seal_ts <= position.timestamp


def complete_flush(seg: SegmentInfo, position: MsgPosition) -> SegmentInfo | None:
    """Sealed/Flushing -> Flushed (Dropped if it has no rows) once `position` holds
    all its rows; the dml position stays, or becomes `position`. An L1/L2 segment is
    Flushed invisible (served as growing until its sorted copy replaces it), stamped with
    the time of its flush."""
    if not ready_to_flush(seg, position):
        return None
    dml_position = seg.dml_position or position
    if not seg.num_rows:
        return seg.with_changes(state=SegmentState.DROPPED, dml_position=dml_position)
    return seg.with_changes(
        state=SegmentState.FLUSHED,
        dml_position=dml_position,
        is_invisible=seg.level is not SegmentLevel.L0,
        flushed_at=time.time(),
    )
