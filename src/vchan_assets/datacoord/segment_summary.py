"""The segment summary, `meta/summary/{collection}`: a collection's segment meta counted.

Milvus' DataCoord answers its metrics and `GetSegmentInfo` from `meta.go` in memory;
`vchan status` runs in another process, and a whole listing of segment meta is about 1 KB a
segment (100 MB at 100,000 segments). So the active DataCoord counts, at each meta reload,
the segments it already holds (its segment cache, or the reload's own listing) and keeps
one small record per collection (`SegmentSummary`): per vchannel, state and level the
segments, rows, insert binlog bytes, how many are sorted, invisible and compacted; the
oldest invisible segments (the hand-off's oldest wait and the late ones status names);
the flush -> sorted times as a histogram on a log scale (quantiles to within
LATENCY_RATIO's half step, about 2 %); and the revision and time it was computed at.

- **Written only when it changed**: the stored records are read (one small prefix, a key
  per collection) and a collection's is put only when its counts differ, by
  compare-version-and-swap, and never over one computed from a newer listing. An idle
  stack writes nothing; its summaries keep the time of their last change.
- **Every collection has one**: each collection key (dropped ones too) gets a record, an
  empty one while it has no segment; a summary of a collection whose key and segments are
  gone is deleted. `missing` finds a collection without one (keys only), so a new
  collection gets its empty summary at the next reload, and a stack upgraded from a
  version before summaries gets them at the first.
- **Under the DataCoord's term**: the writes go through the store they are given: the
  coordinator's, fenced by its election term.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.store import KeyValue, MetaStore
from vchan_assets.model import (
    InvisibleSegment,
    LatencyBucket,
    SegmentGroup,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    SegmentSummary,
)

log = logging.getLogger(__name__)

# The hand-off's late segments status lists (the oldest first), and so how many each
# collection's summary keeps.
OLDEST_KEPT = 20
# The flush -> sorted histogram: bucket b > 0 holds the times in
# (LATENCY_FLOOR * r^(b-1), LATENCY_FLOOR * r^b], bucket 0 those at or below the floor.
LATENCY_RATIO = 2 ** (1 / 16)
LATENCY_FLOOR = 0.01  # seconds

COUNTS = ("segments", "rows", "binlog_bytes", "sorted", "invisible", "compacted")
INVISIBLE = COUNTS.index("invisible")


def latency_bucket(seconds: float) -> int:
    if seconds <= LATENCY_FLOOR:
        return 0
    return max(1, math.ceil(math.log(seconds / LATENCY_FLOOR, LATENCY_RATIO) - 1e-9))


def bucket_seconds(bucket: int) -> float:
    """The time a bucket stands for: the geometric middle of its bounds (the floor for 0)."""
    return LATENCY_FLOOR if bucket == 0 else LATENCY_FLOOR * LATENCY_RATIO ** (bucket - 0.5)


def latency_quantile(buckets: Iterable[LatencyBucket], q: float) -> float | None:
    """The `q` quantile (nearest rank) of merged histograms, None when they are empty."""
    counts: Counter[int] = Counter()
    for b in buckets:
        counts[b.bucket] += b.count
    total = sum(counts.values())
    if not total:
        return None
    rank = round(q * (total - 1))
    seen = 0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen > rank:
            return bucket_seconds(bucket)
    raise AssertionError("unreachable: the rank is below the total")


def summarize(
    segments: Iterable[SegmentInfo], collections: Iterable[int], revision: int, now: float
) -> dict[int, SegmentSummary]:
    """The summary of each collection of `collections` and of each the segments belong to."""
    # per collection, per (vchannel, state, level): each segment's counts, added up column
    # by column at the end (this runs over every segment at each reload that saw a change;
    # each record's row is computed once per version: `SegmentInfo.summary_row`)
    rows: dict[int, dict[tuple[str, SegmentState, SegmentLevel], list[tuple[int, ...]]]] = {
        c: {} for c in collections
    }
    waiting: dict[int, list[InvisibleSegment]] = {}
    latency: dict[int, Counter[int]] = {}
    for seg in segments:
        key, counts = seg.summary_row
        by = rows.get(seg.collection_id)
        if by is None:
            by = rows[seg.collection_id] = {}
        group = by.get(key)
        if group is None:
            by[key] = [counts]
        else:
            group.append(counts)
        if counts[INVISIBLE] and seg.flushed_at is not None:
            waiting.setdefault(seg.collection_id, []).append(
                InvisibleSegment(seg.id, seg.vchannel, seg.flushed_at)
            )
        took = seg.flush_to_sorted
        if took is not None:
            latency.setdefault(seg.collection_id, Counter())[latency_bucket(took)] += 1
    groups = {
        cid: {key: [sum(column) for column in zip(*group, strict=True)] for key, group in by.items()}
        for cid, by in rows.items()
    }
    return {
        cid: SegmentSummary(
            cid,
            tuple(SegmentGroup(v, state, level, *c) for (v, state, level), c in sorted(by.items())),
            tuple(sorted(waiting.get(cid, ()), key=lambda s: (s.flushed_at, s.segment_id))[:OLDEST_KEPT]),
            tuple(LatencyBucket(b, n) for b, n in sorted(latency.get(cid, Counter()).items())),
            revision,
            now,
        )
        for cid, by in sorted(groups.items())
    }


def collection_ids(store: MetaStore) -> set[int]:
    """The id of every collection key, dropped ones included (keys only)."""
    prefix = store.keys.collection.prefix
    return {int(kv.key[len(prefix) :]) for kv in store.list_prefix(prefix, keys_only=True).items}


def missing(store: MetaStore) -> set[int]:
    """The collections without a summary (two keys-only listings of a key per collection)."""
    prefix = store.keys.segment_summary.prefix
    held = {int(kv.key[len(prefix) :]) for kv in store.list_prefix(prefix, keys_only=True).items}
    return collection_ids(store) - held


def write_summaries(
    store: MetaStore, segments: Sequence[SegmentInfo], revision: int, now: float | None = None
) -> list[int]:
    """Count `segments` (every segment, listed at `revision`) and put each collection's
    summary that changed; delete those of collections gone. Returns the collections written."""
    now = time.time() if now is None else now
    fresh = summarize(segments, collection_ids(store), revision, now)
    family = store.keys.segment_summary
    held = {int(kv.key[len(family.prefix) :]): kv for kv in store.list_prefix(family.prefix).items}
    written = []
    for cid, summary in fresh.items():
        kv = held.get(cid)
        old = _decoded(store, kv)
        if old is not None and (old.same_counts(summary) or old.revision >= revision):
            continue
        if _swap(store, family(cid), kv.version if kv else 0, summary):
            written.append(cid)
    for cid, kv in held.items():
        if cid not in fresh:
            _swap(store, kv.key, kv.version, None)
    return written


def _decoded(store: MetaStore, kv: KeyValue | None) -> SegmentSummary | None:
    """The stored summary; a malformed one is logged and counted, then written over."""
    if kv is None:
        return None
    found = store.decode_models([kv], SegmentSummary, skip_malformed=True)
    return found[0].model if found else None


def _swap(store: MetaStore, key: str, version: int, summary: SegmentSummary | None) -> bool:
    try:
        store.cas(key, version, summary)
    except CasConflictError as exc:
        # Another reload wrote it meanwhile (a newer term, the lifecycle run): the next
        # reload compares again.
        log.info("segment summary not written: %s", exc)
        return False
    return True
