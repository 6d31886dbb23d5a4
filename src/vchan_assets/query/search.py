"""Search: the k nearest rows of each query vector in a collection, at a timestamp.

    search(system, info, vectors, SearchOptions(k=10, field=None, metric=None, filter=None,
           as_of=None, params=None, output_fields=())) -> Arrow table (query, <pk>, distance, *fields)

It reads what `read_collection` reads at T (`query.asof`: the segments the query views
served at T, and each vchannel's log after its checkpoint), and searches each part the
best way it can:

- a segment whose build of the field's index is Finished with files: through its faiss
  index, loaded from `index_files/...` (kept in a small cache: index files never change);
- every other part exactly, with numpy: growing and unsorted segments, segments whose
  build is not done, Finished builds without files (FLAT, under 1,024 rows), the log tail;
  and a segment whose index cannot be used: its file missing or unreadable (its build is
  re-issued and its index task queued: `indexes.tasks.queue_rebuild`), or of an index
  engine version this process does not read (`indexes.engine`). Those are reported: an
  `IndexFallbackWarning` and a log line each, and `exact_segments(result)`.

Rows a read at T would not return are never candidates: rows after T, rows a delete at or
before T removes (Milvus' rule, per partition), rows the `filter` rejects. For an indexed
segment they are left out with a faiss ID selector (a bitmap over the segment's rows), so
the index returns the k best of the rows that are left; when less than
`MIN_SELECTED_FOR_INDEX` of a segment's rows are left, it is searched exactly (as Knowhere
does under strict filters: a graph or IVF search over mostly excluded rows loses recall).
The candidates of every part are merged: the k best per query.

Distances: L2 is the squared Euclidean distance (smaller is nearer); IP the inner
product and COSINE the cosine similarity (larger is nearer), as Milvus reports them.

A sparse float vector field is searched by IP only (Milvus' one sparse metric): queries
are sparse vectors as an insert takes them (dicts {index: value}, (indices, values)
pairs, a scipy.sparse matrix), scored over the indices they share with a row
(`indexes.sparse`: through a segment's inverted index, or exactly by the same product
over the rows read); a row sharing none with a query is not a hit of it.
product and COSINE the cosine similarity (larger is nearer), as Milvus reports them. Binary
vectors (queries as (n, dim / 8) uint8 packed bits, or `bytes` each) are searched by
HAMMING (the default) or JACCARD, smaller nearer (`indexes.binary`); a float metric on
them, or a binary one on float vectors, is refused. A BIN_IVF_FLAT segment searched with a
filter, or by JACCARD, probes its lists as faiss would and ranks their vectors here: faiss's
binary IVF index takes no ID selector and measures Hamming distances only.
`filter` is a pandas expression over the scalar fields (`"n > 3 and tag == 'a'"`, with
Milvus' JSON paths and array functions: `meta["color"] == 'red'`, `array_contains(tags,
'x')`; `query.filters`) or a `pyarrow.compute` expression (`pc.field("n") > 3`).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.datacoord.read_pins import pin_or_lost, shared_pin
from vchan_assets.fields import Column, FieldValueError, binary_matrix, vector_matrix
from vchan_assets.indexes import binary, sparse
from vchan_assets.indexes.build import load_index, prepared
from vchan_assets.indexes.engine import OURS, unreadable_reason
from vchan_assets.indexes.meta import describe, list_indexes
from vchan_assets.indexes.params import check_fits, default_ef, default_metric, default_nprobe, search_params
from vchan_assets.indexes.tasks import memory_dim, queue_rebuild
from vchan_assets.meta.store import Decoded
from vchan_assets.model import (
    DYNAMIC_FIELD,
    CollectionInfo,
    DataType,
    FieldIndex,
    FieldSchema,
    IndexEngine,
    IndexType,
    MetricType,
    SegmentIndex,
    SegmentIndexState,
    SegmentInfo,
)
from vchan_assets.query.asof import MetaAt, at_or_before, meta_at, replanned, resolve_as_of, tail_of
from vchan_assets.query.filters import FilterExpressionError, filter_mask, key_partitions_of
from vchan_assets.query.search_options import SearchError, SearchOptions
from vchan_assets.query.view import (
    delete_paths,
    readable_ids,
)
from vchan_assets.storage import Storage, StorageError
from vchan_assets.storage.cache import ReadCache
from vchan_assets.storage.rows import (
    apply_deletes_to,
    concat_deletes,
    read_deletes,
    segment_rows,
    segment_vectors,
)
from vchan_assets.system import System
from vchan_assets.wal.format import arrow_type

log = logging.getLogger(__name__)

# Below this share of a segment's rows left by deletes, T and the filter, the segment is
# searched exactly rather than through its index (Knowhere switches at a 93% filter ratio).
MIN_SELECTED_FOR_INDEX = 0.07
# Rows of one block of an exact search: bounds its distance matrix to queries x this.
EXACT_BLOCK = 65_536
INDEX_CACHE_SIZE = 32
SCALAR_CACHE_BYTES = 512 << 20

_POS = "__position"
_FAISS: Any = faiss  # (its type stubs lack the search parameter classes)


class IndexFallbackWarning(UserWarning):
    """A segment's index could not be used (its file is missing or unreadable, or of an
    engine version this process does not read): the segment was searched exactly."""


# The result's schema metadata key listing the segments searched exactly instead of
# through their index (`exact_segments`).
EXACT_SEGMENTS = b"vchan.exact_segments"


@dataclass(frozen=True)
class Fallback:
    """A segment with a Finished index searched exactly: why, and whether its build is
    to be rebuilt (a missing or unreadable file; not a file of another engine version)."""

    segment: int
    file: str
    reason: str
    rebuild: bool

    def message(self) -> str:
        return f"segment {self.segment}: index file {self.file} is unusable ({self.reason}); searched exactly"


def exact_segments(result: pa.Table) -> list[dict[str, Any]]:
    """The segments a search result was searched exactly although they have an index:
    [{segment, file, reason}] (empty when every index was used)."""
    raw = (result.schema.metadata or {}).get(EXACT_SEGMENTS)
    return list(json.loads(raw)) if raw else []


@dataclass(frozen=True)
class SearchRequest:
    """A search, checked against the collection's schema and the field's index."""

    field: FieldSchema
    metric: MetricType
    k: int
    # (nq, dim) float32, normalized for COSINE; binary: (nq, dim / 8) uint8; sparse: scipy CSR
    queries: Any
    index: FieldIndex | None
    params: Mapping[str, int | float]
    filter: str | pc.Expression | None
    output_fields: tuple[str, ...]
    collection: str
    pk: str
    scalars: tuple[str, ...]  # the pk and scalar fields: what a filter sees
    result_schema: pa.Schema
    json_fields: tuple[str, ...] = ()  # the JSON fields among the scalars (a filter follows their paths)

    @property
    def larger_is_nearer(self) -> bool:
        return self.metric.larger_is_nearer


def search(
    system: System,
    info: CollectionInfo,
    vectors: Any,
    options: SearchOptions | None = None,
    engine: IndexEngine = OURS,
) -> pa.Table:
    """The k nearest rows of each query vector (module docstring) as `options` ask
    (default: `SearchOptions()`): one row per hit, `query` (the query's position in
    `vectors`), the primary key, `distance` and the output fields, sorted by query and
    nearness. `engine`: the index engine versions this process reads (what its reader
    session states). The segments searched exactly although indexed are listed in the
    result's metadata (`exact_segments`)."""
    options = options or SearchOptions()
    ts = resolve_as_of(system.store, system.settings, options.as_of)

    with shared_pin(system.store, system.settings, info.id, ts) as pin, pin_or_lost(system.store, pin):
        # (the log tails are read while planning)
        request, plan = replanned(lambda: planned(system, info, vectors, options, ts))
        hits = plan.tail_hits(request)
        fallbacks = []
        for part in plan.parts:
            found, fallback = search_segment(system.storage, request, part, engine)
            hits += found
            fallbacks += [fallback] if fallback is not None else []
        return finish(system, info, request, hits, fallbacks, plan.builds)


def check_request(
    system: System,
    info: CollectionInfo,
    vectors: Any,
    options: SearchOptions,
    indexes: Sequence[FieldIndex] | None = None,
) -> SearchRequest:
    """The search checked against the collection before any file is read (the options
    are checked already: `SearchOptions`): SearchError naming what is wrong. `indexes`:
    the collection's live indexes, when the caller listed them (`meta_at`)."""

    def error(reason: str) -> SearchError:
        return SearchError(info.name, reason)

    target = _vector_field(info, options.field, error)
    if target.is_sparse:
        queries = _sparse_queries(vectors, error)
    elif target.is_binary_vector:
        queries = _binary_queries(target, vectors, error)
    else:
        queries = _dense_queries(target, vectors, error)
    if indexes is None:
        indexes = [d.model for d in list_indexes(system.store, info.id)]
    found_index = next((i for i in indexes if i.field_id == target.field_id), None)
    chosen = _metric(options.metric, found_index, target)
    try:
        check_fits(target, chosen)
    except ValueError as exc:
        raise error(str(exc)) from None
    if found_index is not None and chosen is not found_index.metric:
        raise error(
            f"metric {chosen} does not match the index {describe(found_index)}: search with {found_index.metric}"
        )
    params = options.params or {}
    checked: dict[str, int | float] = {}
    if found_index is not None:
        try:
            checked = search_params(found_index.type, params, options.k)
        except ValueError as exc:
            raise error(f"{exc} (index {describe(found_index)})") from None
    elif params:
        raise error(f"field {target.name!r} has no index: search parameters {sorted(params)} do not apply")
    scalars = {f.name for f in info.schema.scalar_fields}
    for name in options.output_fields:
        if name not in scalars:
            raise error(
                f"output field {name!r} is not a scalar field of the collection ({', '.join(sorted(scalars))})"
            )
    fields = [
        pa.field("query", pa.int64()),
        pa.field(info.schema.primary.name, arrow_type(info.schema.primary)),
    ]
    fields += [pa.field("distance", pa.float32())]
    fields += [pa.field(name, arrow_type(info.schema.field(name))) for name in options.output_fields]
    return SearchRequest(
        field=target,
        metric=chosen,
        k=options.k,
        queries=queries if target.is_sparse else prepared(queries, chosen),
        index=found_index,
        params=checked,
        filter=options.filter,
        output_fields=tuple(options.output_fields),
        collection=info.name,
        pk=info.schema.primary.name,
        scalars=tuple(f.name for f in info.schema.scalar_fields),
        json_fields=tuple(f.name for f in info.schema.fields if f.dtype is DataType.JSON),
        result_schema=pa.schema(fields),
    )


def _dense_queries(target: FieldSchema, vectors: Any, error: Any) -> np.ndarray:
    """Query vectors of a dense field: an (n, dim) float32 matrix."""
    assert target.dim is not None
    try:
        queries = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise error(f"query vectors must be an array of numbers of shape (n, {target.dim}): {exc}") from None
    if queries.ndim == 1:
        queries = queries.reshape(1, -1)
    if queries.ndim != 2 or not len(queries):
        raise error(
            f"query vectors must be one vector or an (n, {target.dim}) array, got shape {queries.shape}"
        )
    if queries.shape[1] != target.dim:
        raise error(
            f"query vectors have dimension {queries.shape[1]}, field {target.name!r} has {target.dim}"
        )
    if not np.isfinite(queries).all():
        raise error("query vectors hold NaN or infinite values")
    return queries


def _sparse_queries(vectors: Any, error: Any) -> Any:
    try:
        queries = sparse.sparse_queries(vectors)
    except FieldValueError as exc:
        where = "" if exc.row is None else f" (query {exc.row})"
        raise error(f"a sparse query vector {exc.reason}{where}") from None
    except (TypeError, ValueError) as exc:
        raise error(
            f"sparse query vectors must be dicts {{index: value}} or (indices, values): {exc}"
        ) from None
    if not queries.shape[0]:
        raise error("no query vectors: give one or more")
    return queries


def _binary_queries(target: FieldSchema, vectors: Any, error: Any) -> np.ndarray:
    """Query vectors of a binary field as `fields.binary_matrix` takes them (or one of
    them: `bytes`, or a 1-d uint8 or bool array): an (n, dim / 8) uint8 matrix."""
    if isinstance(vectors, bytes | bytearray):
        vectors = [vectors]
    elif isinstance(vectors, np.ndarray) and vectors.ndim == 1:
        vectors = vectors.reshape(1, -1)
    try:
        queries = binary_matrix(target, vectors)
    except FieldValueError as exc:
        raise error(f"query vectors of the binary vector field {target.name!r}: {exc}") from None
    if not len(queries):
        raise error("no query vectors")
    return queries


def _vector_field(info: CollectionInfo, field: str | None, error: Any) -> FieldSchema:
    vectors = info.schema.vector_fields
    names = ", ".join(f.name for f in vectors)
    if field is None:
        if len(vectors) != 1:
            raise error(f"the collection has several vector fields ({names}): name one")
        return vectors[0]
    try:
        found = info.schema.field(field)
    except KeyError:
        raise error(f"no field {field!r} (vector fields: {names})") from None
    if not found.is_vector:
        raise error(f"field {field!r} is not a vector field (vector fields: {names})")
    return found


def _metric(metric: MetricType | str | None, index: FieldIndex | None, field: FieldSchema) -> MetricType:
    """The metric asked for (named already: `SearchOptions`), else the index's, else the
    field's default (L2, HAMMING for binary vectors, IP for sparse ones)."""
    if metric is not None:
        return MetricType(metric)
    return index.metric if index is not None else default_metric(field)


# --- the parts of a read at T ---------------------------------------------------------------


@dataclass(frozen=True)
class SegmentPart:
    """One segment of a search at T: what its search needs (picklable, for a Spark task)."""

    segment: SegmentInfo
    build: SegmentIndex | None  # its Finished build with files, if any
    deletes: pa.Table  # of its partition, at or before T
    ts: int
    expired_before: int = 0  # rows inserted before this a TTL expired at T (0: none)


@dataclass(frozen=True)
class SearchPlan:
    """A search at T: the segments served at T, each with its build and deletes, and the
    log tail's rows (read here: small)."""

    parts: list[SegmentPart]
    tails: list[tuple[pa.Table, pa.Table]]  # (rows of one partition, its deletes)
    builds: dict[int, Decoded[SegmentIndex]]  # by segment: to re-issue a build found unusable
    ts: int
    expired_before: int = 0  # rows inserted before this a TTL expired at T (0: none)

    def tail_hits(self, request: SearchRequest) -> list[pa.Table]:
        hits: list[pa.Table] = []
        for rows, deletes in self.tails:
            allowed = _allowed(request, rows, deletes, self.ts, self.expired_before)
            hits += _exact(request, rows, _vectors(request.field, rows[request.field.name]), allowed)
        return hits


def planned(
    system: System, info: CollectionInfo, vectors: Any, options: SearchOptions, ts: int
) -> tuple[SearchRequest, SearchPlan]:
    """The search checked and planned from the meta listed at `ts` (the checkpoints before
    the segments: `meta_at`). A filter on the partition key lists only the partitions it
    keeps: their segments, their dropped records and their index builds."""
    partitions = key_partitions_of(info, options.filter)
    meta = meta_at(system.store, info, ts, builds=True, partitions=partitions)
    request = check_request(system, info, vectors, options, meta.indexes)
    return request, plan_search(system, info, request, meta, ts)


def plan_search(
    system: System, info: CollectionInfo, request: SearchRequest, meta: MetaAt, ts: int
) -> SearchPlan:
    """The parts of a search at T from the meta listed at T (`meta_at` with its builds)."""
    storage = system.storage
    expired = info.expired_before(ts)
    segments, views = meta.segments, meta.views
    tails = [tail_of(view, segments, ts).read(storage, info, with_vectors=True) for view in views]
    keep = key_partitions_of(info, request.filter)  # a filter on the partition key prunes partitions
    readable = readable_ids(views)
    served = {s.id for s in segments if s.id in readable and (keep is None or s.partition_id in keep)}
    parts = {s.partition_id for s in segments if s.id in served}
    parts |= {p for tail in tails for p in pc.unique(tail.rows["partition_id"]).to_pylist()}
    if keep is not None:
        parts &= keep
    deletes = {}
    for part in parts:
        found = [read_deletes(storage, delete_paths(views, part))]
        found += [tail.deletes[part] for tail in tails if part in tail.deletes]
        deletes[part] = at_or_before(concat_deletes(found), ts)
    builds = _finished_builds(meta.builds, request.index)
    segment_parts = [
        SegmentPart(
            seg, builds[seg.id].model if seg.id in builds else None, deletes[seg.partition_id], ts, expired
        )
        for seg in segments  # in key order, as listed
        if seg.id in served
    ]
    tail_parts = []
    for tail in tails:
        for part in pc.unique(tail.rows["partition_id"]).to_pylist():
            if part in parts:
                tail_parts.append(
                    (tail.rows.filter(pc.equal(tail.rows["partition_id"], part)), deletes[part])
                )
    return SearchPlan(segment_parts, tail_parts, builds, ts, expired)


def finish(
    system: System,
    info: CollectionInfo,
    request: SearchRequest,
    hits: list[pa.Table],
    fallbacks: list[Fallback],
    builds: Mapping[int, Decoded[SegmentIndex]] | None = None,
) -> pa.Table:
    """The k best hits per query, with the segments searched exactly although indexed
    reported: a warning and a log line each, the list in the result's metadata, and a
    rebuild queued for a missing or unreadable file (`indexes.tasks.queue_rebuild`)."""
    for fallback in fallbacks:
        log.warning("%s", fallback.message())
        warnings.warn(fallback.message(), IndexFallbackWarning, stacklevel=3)
        build = (builds or {}).get(fallback.segment)
        if (
            fallback.rebuild
            and build is not None
            and queue_rebuild(system.store, build, memory_dim(request.field))
        ):
            log.warning(
                "segment %d: rebuild of index build %d queued", fallback.segment, build.model.build_id
            )
    listed = [{"segment": f.segment, "file": f.file, "reason": f.reason} for f in fallbacks]
    merged = merge_hits(request, hits)
    if not listed:
        return merged
    return merged.replace_schema_metadata(
        {**(merged.schema.metadata or {}), EXACT_SEGMENTS: json.dumps(listed)}
    )


def _finished_builds(
    builds: Sequence[Decoded[SegmentIndex]], index: FieldIndex | None
) -> dict[int, Decoded[SegmentIndex]]:
    if index is None:
        return {}
    return {
        d.model.segment_id: d
        for d in builds
        if d.model.index_id == index.index_id
        and d.model.state is SegmentIndexState.FINISHED
        and d.model.files
    }


def _allowed(
    request: SearchRequest, rows: pa.Table, deletes: pa.Table, ts: int, expired_before: int = 0
) -> np.ndarray:
    """Which rows are candidates: at or before T, not expired at T (TTL), not deleted at or
    before T, kept by the filter (a bool per row)."""
    n = rows.num_rows
    if not deletes.num_rows:  # the common case: a comparison, no join
        allowed = np.asarray(rows["timestamp"].to_numpy() <= ts)
    else:
        keyed = pa.table({request.pk: rows[request.pk], "timestamp": rows["timestamp"], _POS: np.arange(n)})
        kept = apply_deletes_to(at_or_before(keyed, ts), deletes, request.pk)
        allowed = np.zeros(n, dtype=bool)
        allowed[kept[_POS].to_numpy()] = True
    if expired_before:
        allowed &= rows["timestamp"].to_numpy() >= expired_before
    if request.filter is not None and allowed.any():
        allowed &= _filter_mask(request, rows)
    return allowed


def _filter_mask(request: SearchRequest, rows: pa.Table) -> np.ndarray:
    scalars = rows.select(list(request.scalars))
    try:
        if isinstance(request.filter, pc.Expression):
            indexed = scalars.append_column(_POS, pa.array(np.arange(rows.num_rows)))
            keep = np.zeros(rows.num_rows, dtype=bool)
            keep[indexed.filter(request.filter)[_POS].to_numpy()] = True
            return keep
        assert request.filter is not None
        return filter_mask(request.filter, scalars, request.json_fields, DYNAMIC_FIELD)
    except FilterExpressionError as exc:
        raise SearchError(request.collection, str(exc)) from None
    except Exception as exc:  # a mistaken pyarrow expression: pyarrow raises many kinds
        raise SearchError(
            request.collection, f"filter {request.filter!r} failed: {type(exc).__name__}: {exc}"
        ) from None


def search_segment(
    storage: Storage, request: SearchRequest, part: SegmentPart, engine: IndexEngine = OURS
) -> tuple[list[pa.Table], Fallback | None]:
    """One segment's candidates: through its index when it has a usable one, else exactly
    (with the Fallback that says why, when it has an index). Touches no etcd: runs in a
    Spark task too."""
    seg, build = part.segment, part.build
    rows = _cached_scalars(storage, seg)
    if not rows.num_rows:
        return [], None  # no rows left (its binlogs quarantined): no columns to read either
    allowed = _allowed(request, rows, part.deletes, part.ts, part.expired_before)
    if not allowed.any():
        return [], None
    fallback = None
    if build is not None and allowed.mean() >= MIN_SELECTED_FOR_INDEX:
        reason = unreadable_reason(build, engine)
        if reason is not None:
            fallback = Fallback(seg.id, build.files[0], reason, rebuild=False)
        else:
            try:
                index = _cached_index(storage, build.files[0])
                if index.ntotal != rows.num_rows:
                    raise RuntimeError(f"it holds {index.ntotal} rows, the segment {rows.num_rows}")
                return [_indexed(request, rows, index, allowed)], None
            except (StorageError, RuntimeError) as exc:
                fallback = Fallback(seg.id, build.files[0], str(exc), rebuild=True)
    return _exact(request, rows, _segment_vectors(storage, seg, request.field), allowed), fallback


def _vectors(field: FieldSchema, column: Column) -> Any:
    """A vector column as searched: a float32 matrix, or a sparse field's CSR matrix."""
    return sparse.sparse_rows(column) if field.is_sparse else vector_matrix(field, column)


def _segment_vectors(storage: Storage, seg: SegmentInfo, field: FieldSchema) -> Any:
    return (
        sparse.segment_rows(storage, seg, field) if field.is_sparse else segment_vectors(storage, seg, field)
    )


# --- through an index -----------------------------------------------------------------------


def _indexed(request: SearchRequest, rows: pa.Table, index: Any, allowed: np.ndarray) -> pa.Table:
    if isinstance(index, sparse.InvertedIndex):
        queries = sparse.drop_small(request.queries, float(request.params.get("drop_ratio_search", 0.0)))
        scores = index.scores(queries)
        distances, positions = sparse.top_k(scores, request.k, None if allowed.all() else allowed)
        return _hits(request, rows, distances, positions)
    n = index.ntotal
    assert request.index is not None
    if request.field.is_binary_vector:  # BIN_IVF_FLAT: no ID selector in faiss (indexes.binary)
        nprobe = int(request.params.get("nprobe", default_nprobe(index.nlist)))
        chosen = None if allowed.all() else allowed
        distances, positions = binary.ivf_search(
            index, request.queries, min(request.k, n), nprobe, request.metric, chosen
        )
        return _hits(request, rows, distances, positions)
    packed = None if allowed.all() else np.packbits(allowed, bitorder="little")
    selector = None if packed is None else faiss.IDSelectorBitmap(n, faiss.swig_ptr(packed))
    params: Any
    if request.index.type is IndexType.HNSW:
        params = _FAISS.SearchParametersHNSW()
        params.efSearch = request.params.get("ef", default_ef(request.k))
    else:
        params = _FAISS.SearchParametersIVF()
        params.nprobe = request.params.get("nprobe", default_nprobe(faiss.extract_index_ivf(index).nlist))
    if selector is not None:
        params.sel = selector
    distances, positions = index.search(request.queries, min(request.k, n), params=params)
    return _hits(request, rows, distances, positions)


_INDEXES: ReadCache[Any] = ReadCache(INDEX_CACHE_SIZE)
# The pk, timestamp and scalar columns of segments searched through their index: what a
# search reads besides the index, on every call (at 1M rows, ~0.1 s a call uncached).
_SCALARS: ReadCache[pa.Table] = ReadCache(SCALAR_CACHE_BYTES, weigh=lambda table: table.nbytes)


def _cached_index(storage: Storage, key: str) -> Any:
    return _INDEXES.get((storage.base, key), lambda: load_index(storage.read_bytes(key), key))


def _cached_scalars(storage: Storage, seg: SegmentInfo) -> pa.Table:
    """`segment_rows(seg, with_vectors=False)`, cached by the segment's binlog paths (a
    segment's binlogs only ever change by new files, never in place)."""
    paths = tuple(b.path for g in seg.binlogs for b in g.logs)
    return _SCALARS.get((storage.base, seg.id, paths), lambda: segment_rows(storage, seg, with_vectors=False))


# --- exactly ----------------------------------------------------------------------------------


def _exact(
    request: SearchRequest, rows: pa.Table, vectors: np.ndarray, allowed: np.ndarray
) -> list[pa.Table]:
    """The k best allowed rows per query by brute force, block by block (each block's
    best are candidates of the merge)."""
    positions = np.flatnonzero(allowed)
    if not len(positions):
        return []
    if request.field.is_sparse:
        return _exact_sparse(request, rows, vectors, positions)
    base = prepared(vectors[positions], request.metric)
    if request.field.is_binary_vector:
        return _exact_binary(request, rows, base, positions)
    out = []
    for start in range(0, len(base), EXACT_BLOCK):
        block = base[start : start + EXACT_BLOCK]
        scores = request.queries @ block.T
        if request.metric is MetricType.L2:
            scores = np.maximum(
                (request.queries**2).sum(1)[:, None] - 2 * scores + (block**2).sum(1)[None, :], 0.0
            )
        take = min(request.k, len(block))
        order = -scores if request.larger_is_nearer else scores
        best = np.argpartition(order, take - 1, axis=1)[:, :take]
        distances = np.take_along_axis(scores, best, axis=1)
        out.append(_hits(request, rows, distances, positions[start + best]))
    return out


def _exact_sparse(
    request: SearchRequest, rows: pa.Table, vectors: Any, positions: np.ndarray
) -> list[pa.Table]:
    """The k best allowed rows per query by the product over the rows' own posting lists
    (what their index computes, built for this search)."""
    out = []
    for start in range(0, len(positions), EXACT_BLOCK):
        block = positions[start : start + EXACT_BLOCK]
        scores = sparse.InvertedIndex.of(vectors[block]).scores(request.queries)
        distances, found = sparse.top_k(scores, request.k)
        out.append(_hits(request, rows, distances, np.where(found >= 0, block[found], -1)))
    return out


def _exact_binary(
    request: SearchRequest, rows: pa.Table, base: np.ndarray, positions: np.ndarray
) -> list[pa.Table]:
    """`_exact` of binary vectors: HAMMING or JACCARD distances by `indexes.binary`, in
    blocks bounded by their unpacked bits."""
    assert request.field.dim is not None
    step = min(EXACT_BLOCK, binary.block_rows(request.field.dim))
    out = []
    for start in range(0, len(base), step):
        distances, best = binary.nearest(
            request.queries, base[start : start + step], request.metric, request.k
        )
        out.append(_hits(request, rows, distances, positions[start + best]))
    return out


# --- hits and their merge -----------------------------------------------------------------------


def _hits(request: SearchRequest, rows: pa.Table, distances: np.ndarray, positions: np.ndarray) -> pa.Table:
    """Candidates (query, pk, distance, output fields) from (nq, k) distances and row
    positions (-1: no row, as faiss pads)."""
    nq, width = positions.shape
    queries = np.repeat(np.arange(nq, dtype=np.int64), width)
    flat = positions.reshape(-1)
    found = flat >= 0
    taken = pa.array(flat[found])
    columns = {
        "query": pa.array(queries[found]),
        request.pk: rows[request.pk].take(taken),
        "distance": pa.array(distances.reshape(-1)[found].astype(np.float32)),
    }
    for name in request.output_fields:
        columns[name] = rows[name].take(taken)
    return pa.table(columns)


def merge_hits(request: SearchRequest, hits: list[pa.Table]) -> pa.Table:
    """The k best candidates per query, sorted by query, nearness, then pk."""
    if not hits:
        return request.result_schema.empty_table()
    table = pa.concat_tables(hits, promote_options="permissive").cast(request.result_schema)
    best = _best_by_rows(request, hits, table)
    if best is not None:
        return table.take(best)
    nearness = "descending" if request.larger_is_nearer else "ascending"
    table = table.sort_by([("query", "ascending"), ("distance", nearness), (request.pk, "ascending")])
    query = table["query"].to_numpy()
    rank = np.arange(len(query)) - np.searchsorted(query, query, side="left")
    return table.filter(pa.array(rank < request.k))


def _best_by_rows(request: SearchRequest, hits: list[pa.Table], table: pa.Table) -> np.ndarray | None:
    """`merge_hits`' rows of `table` (the `hits` concatenated) when every table of hits
    holds the same number of candidates for each query, query by query (what an index or
    an exact search gives when no row is left out) and the pk is an integer: the
    candidates laid out as one row per query and ordered row by row (a sort of each
    query's few candidates, not of all of them: under half the time at 1,000 queries).
    None otherwise (the caller sorts the table)."""
    nq = request.queries.shape[0]
    if not pa.types.is_integer(table.schema.field(request.pk).type):
        return None
    widths = []
    for hit in hits:
        width, left = divmod(hit.num_rows, nq)
        query = hit["query"].to_numpy()
        if left or not width or (query.reshape(nq, width) != np.arange(nq)[:, None]).any():
            return None
        widths.append(width)
    starts = np.cumsum([0, *(nq * w for w in widths)])
    positions = np.hstack(  # (nq, candidates): row q holds the rows of `table` for query q
        [(start + np.arange(nq * w)).reshape(nq, w) for start, w in zip(starts, widths, strict=False)]
    )
    distances = table["distance"].to_numpy()[positions]
    pks = table[request.pk].to_numpy()[positions]
    nearness = -distances if request.larger_is_nearer else distances
    order = np.lexsort((pks, nearness), axis=1)[:, : request.k]  # by nearness, then pk
    return np.take_along_axis(positions, order, axis=1).reshape(-1)
