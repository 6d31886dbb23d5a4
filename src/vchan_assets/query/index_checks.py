"""The segment indexes of a vchannel, checked: what the Dagster `segment_indexes` asset
checks, usable without Dagster.

- `check_builds_finished`: every indexable segment of the vchannel (sorted, Flushed, not L0)
  of at least `MIN_ROWS_TO_BUILD` rows has a Finished build of each live index of its
  collection (a missing, pending, running or Failed build fails the check, with the reason).
- `check_index_rows`: each Finished build with files holds as many rows as its segment
  (the loaded index's `ntotal`, and the rows the build recorded).
- `check_recall`: recall@k of each built index on a sample of its segment's own vectors,
  searched at the default search parameters (`ef` for HNSW, `nprobe` for IVF), against
  exact search over the segment, at least the floor (VCHAN_INDEX_RECALL_FLOOR). IVF_PQ's
  recall is recorded, not judged: its codes are lossy by design. A sparse field's inverted
  index is exact (recall 1.0) unless built with `drop_ratio_build`.
  recall is recorded, not judged: its codes are lossy by design. Binary indexes (HAMMING,
  JACCARD) count a hit found when it is as near as the k-th exact one: their integer
  Hamming distances tie often, and which of the tied rows an exact search returns is
  arbitrary.

Cost: the rows check loads each built index file of the vchannel; the recall check also
reads each indexed segment's vector column group and searches `RECALL_SAMPLE` queries
exactly (rows x sample distances per segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from vchan_assets.datacoord.recovery import channel_segments
from vchan_assets.datanode.checks import CheckOutcome
from vchan_assets.indexes import binary
from vchan_assets.indexes.build import faiss_metric, load_index, prepared
from vchan_assets.indexes.meta import indexable, list_builds, list_indexes
from vchan_assets.indexes.params import default_ef, default_nprobe
from vchan_assets.indexes.sparse import InvertedIndex, top_k
from vchan_assets.indexes.sparse import segment_rows as sparse_segment_rows
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    BINARY_METRICS,
    MIN_ROWS_TO_BUILD,
    CollectionInfo,
    FieldIndex,
    IndexType,
    MetricType,
    SegmentIndex,
    SegmentIndexState,
    SegmentInfo,
)
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import segment_vectors

RECALL_SAMPLE = 100  # query vectors per segment, drawn from its own rows
RECALL_K = 10
_FAISS: Any = faiss  # (its type stubs lack the search parameter classes)


@dataclass(frozen=True)
class VchannelIndexes:
    """The indexable segments of one vchannel, the live indexes of its collection and
    their builds on those segments (by (segment, index))."""

    info: CollectionInfo
    segments: list[SegmentInfo]
    indexes: list[FieldIndex]
    builds: dict[tuple[int, int], SegmentIndex]

    def missing(self) -> list[tuple[SegmentInfo, FieldIndex]]:
        """(segment, index) pairs that have no build yet."""
        return [(s, i) for s in self.segments for i in self.indexes if (s.id, i.index_id) not in self.builds]

    def unissued(self) -> list[SegmentIndex]:
        return [b for b in self.builds.values() if b.state is SegmentIndexState.UNISSUED]

    def built(self) -> list[tuple[SegmentInfo, FieldIndex, SegmentIndex]]:
        """Finished builds with files (the ones searched through an index)."""
        by_id = {i.index_id: i for i in self.indexes}
        return [
            (s, by_id[index_id], b)
            for s in self.segments
            for (seg_id, index_id), b in self.builds.items()
            if seg_id == s.id and b.state is SegmentIndexState.FINISHED and b.files
        ]


def vchannel_indexes(store: MetaStore, info: CollectionInfo, vchannel: str) -> VchannelIndexes:
    segments = sorted(
        (d.model for d in channel_segments(store, info.id, vchannel) if indexable(d.model)),
        key=lambda s: s.id,
    )
    indexes = [d.model for d in list_indexes(store, info.id)]
    if not indexes:  # (most collections: their builds are not listed)
        return VchannelIndexes(info, segments, [], {})
    ids = {s.id for s in segments}
    live = {i.index_id for i in indexes}
    builds = {
        (d.model.segment_id, d.model.index_id): d.model
        for d in list_builds(store, info.id)
        if d.model.segment_id in ids and d.model.index_id in live
    }
    return VchannelIndexes(info, segments, indexes, builds)


def check_builds_finished(found: VchannelIndexes) -> CheckOutcome:
    problems: list[str] = []
    checked = 0
    for seg in found.segments:
        if seg.num_rows < MIN_ROWS_TO_BUILD:
            continue
        for index in found.indexes:
            checked += 1
            b = found.builds.get((seg.id, index.index_id))
            if b is None:
                problems.append(f"segment {seg.id}: no build of index {index.name!r}")
            elif b.state is SegmentIndexState.FAILED:
                problems.append(f"segment {seg.id}: build {b.build_id} failed: {b.fail_reason}")
            elif b.state is not SegmentIndexState.FINISHED:
                problems.append(f"segment {seg.id}: build {b.build_id} is {b.state}")
    metadata: dict[str, int | float | str] = {"builds_checked": checked, "not_finished": len(problems)}
    if problems:
        return CheckOutcome(False, "; ".join(problems[:10]), metadata)
    return CheckOutcome(
        True,
        f"{checked} builds of {len(found.indexes)} indexes over segments of >= {MIN_ROWS_TO_BUILD} rows are Finished",
        metadata,
    )


def _loaded(storage: Storage, b: SegmentIndex) -> Any:
    """The build's index, or the reason it cannot be loaded."""
    try:
        return load_index(storage.read_bytes(b.files[0]), b.files[0])
    except Exception as exc:  # storage errors and faiss's C++ exceptions alike: reported by the check
        return f"index file {b.files[0]} unreadable: {exc}"


def check_index_rows(storage: Storage, found: VchannelIndexes) -> CheckOutcome:
    problems: list[str] = []
    built = found.built()
    for seg, _index, b in built:
        index = _loaded(storage, b)
        if isinstance(index, str):
            problems.append(f"segment {seg.id}: {index}")
        elif not index.ntotal == b.rows == seg.num_rows:
            problems.append(
                f"segment {seg.id}: build {b.build_id} holds {index.ntotal} rows "
                f"(recorded {b.rows}), the segment has {seg.num_rows}"
            )
    metadata: dict[str, int | float | str] = {"indexes_checked": len(built), "mismatched": len(problems)}
    if problems:
        return CheckOutcome(False, "; ".join(problems[:10]), metadata)
    return CheckOutcome(True, f"{len(built)} built indexes hold their segment's rows", metadata)


def segment_recall(
    storage: Storage, info: CollectionInfo, seg: SegmentInfo, index: FieldIndex, b: SegmentIndex
) -> float:
    """recall@RECALL_K of the build's index on up to RECALL_SAMPLE of the segment's own
    vectors at the default search parameters, against exact search over the segment."""
    field = next(f for f in info.schema.vector_fields if f.field_id == index.field_id)
    loaded = _loaded(storage, b)
    if isinstance(loaded, str):
        return 0.0
    if field.is_sparse:
        return sparse_recall(loaded, sparse_segment_rows(storage, seg, field), seg.id, RECALL_K)
    vectors = prepared(segment_vectors(storage, seg, field), index.metric)
    rng = np.random.default_rng(seg.id)
    queries = vectors[rng.choice(len(vectors), min(RECALL_SAMPLE, len(vectors)), replace=False)]
    return recall_at(loaded, vectors, queries, index.type, index.metric, RECALL_K)


def sparse_recall(index: InvertedIndex, rows: Any, seed: int, k: int) -> float:
    """recall@k of a sparse field's inverted index on a sample of its segment's own rows
    against the exact product over the rows (1.0 unless built with a drop ratio)."""
    rng = np.random.default_rng(seed)
    queries = rows[rng.choice(rows.shape[0], min(RECALL_SAMPLE, rows.shape[0]), replace=False)]
    _, truth = top_k(InvertedIndex.of(rows).scores(queries), k)
    _, found = top_k(index.scores(queries), k)
    return float(
        np.mean([len(set(t) & set(f)) / k for t, f in zip(truth.tolist(), found.tolist(), strict=True)])
    )


def recall_at(
    index: Any, vectors: np.ndarray, queries: np.ndarray, kind: IndexType, metric: MetricType, k: int
) -> float:
    """recall@k of a faiss `index` over `vectors` (prepared) at the default search
    parameters, against exact search."""
    if metric in BINARY_METRICS:
        return binary_recall_at(index, vectors, queries, metric, k)
    exact = faiss.IndexFlat(vectors.shape[1], faiss_metric(metric))
    exact.add(vectors)
    _, truth = exact.search(queries, k)
    _, found = search_default(index, queries, kind, k)
    return float(
        np.mean([len(set(t) & set(f)) / k for t, f in zip(truth.tolist(), found.tolist(), strict=True)])
    )


def binary_recall_at(
    index: Any, vectors: np.ndarray, queries: np.ndarray, metric: MetricType, k: int
) -> float:
    """recall@k of a BIN_IVF_FLAT `index` at the default nprobe: the share of its hits
    at most as far as each query's k-th nearest by exact search (ties count as found)."""
    truth, _ = binary.nearest(queries, vectors, metric, k)
    found, positions = binary.ivf_search(index, queries, k, default_nprobe(index.nlist), metric, None)
    within = (found <= truth[:, -1:]) & (positions >= 0)
    return float(within.sum() / (len(queries) * k))


def search_default(
    index: Any, queries: np.ndarray, kind: IndexType, k: int, **params: int
) -> tuple[np.ndarray, np.ndarray]:
    """(distances, positions) of the k nearest by a segment index at the default search
    parameters (or `ef` / `nprobe` given), as `Catalog.search` searches it (a BIN_IVF_FLAT
    index by HAMMING)."""
    search_params: Any
    if kind is IndexType.HNSW:
        search_params = _FAISS.SearchParametersHNSW()
        search_params.efSearch = params.get("ef", default_ef(k))
    elif kind is IndexType.BIN_IVF_FLAT:
        nprobe = params.get("nprobe", default_nprobe(index.nlist))
        return binary.ivf_search(index, queries, k, nprobe, MetricType.HAMMING, None)
    else:
        search_params = _FAISS.SearchParametersIVF()
        nlist = faiss.extract_index_ivf(index).nlist
        search_params.nprobe = params.get("nprobe", default_nprobe(nlist))
    distances, positions = index.search(queries, k, params=search_params)
    return np.asarray(distances), np.asarray(positions)


def check_recall(storage: Storage, found: VchannelIndexes, floor: float) -> CheckOutcome:
    built = found.built()
    recalls: list[tuple[SegmentInfo, FieldIndex, float]] = [
        (seg, index, segment_recall(storage, found.info, seg, index, b)) for seg, index, b in built
    ]
    judged = [r for r in recalls if r[1].type is not IndexType.IVF_PQ]
    low = [f"segment {s.id} ({i.name!r}, {i.type}): {r:.3f}" for s, i, r in judged if r < floor]
    values: Sequence[float] = [r for _, _, r in recalls]
    metadata: dict[str, int | float | str] = {
        "indexes_checked": len(recalls),
        "recall_min": round(min(values), 4) if values else 1.0,
        "recall_mean": round(float(np.mean(values)), 4) if values else 1.0,
        "floor": floor,
    }
    if low:
        return CheckOutcome(False, f"recall@{RECALL_K} below {floor}: " + "; ".join(low[:10]), metadata)
    return CheckOutcome(
        True,
        f"recall@{RECALL_K} of {len(judged)} built indexes at least {floor} "
        f"({len(recalls) - len(judged)} IVF_PQ measured only)",
        metadata,
    )
