"""The build of one segment's index with faiss (what Milvus' Knowhere wraps), and loading it.

A build reads the vectors of the indexed field from the segment's binlogs (its own column
group, in the segment's row order), builds the faiss index whose ids are the rows'
positions in the segment, and writes it whole with `faiss.serialize_index` to
`index_files/{build}/{version}/index.faiss`. Nothing here touches etcd: the caller commits
the files (`indexes.meta.finish_build`) after they are written, so a crash in between leaves
an orphan file, never a half-visible index.

Runs inside a Spark Python worker (one Spark task per build) or in the caller's process;
`BuildSpec` is picklable and the outcome travels back pickled, a typed `IndexBuildError`
included. COSINE indexes hold normalized vectors and search them by inner product.
A sparse field's index is not faiss's: `indexes.sparse` builds it (scipy.sparse), written
to `index_files/{build}/{version}/index.sparse.npz` the same way.
included. COSINE indexes hold normalized vectors and search them by inner product. Binary
vectors' indexes (BIN_IVF_FLAT) are faiss's binary indexes (`indexes.binary`), written with
`faiss.serialize_index_binary`; `load_index` tells the two kinds apart by faiss's header.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import pyarrow as pa

from vchan_assets.errors import DeclaredError
from vchan_assets.failpoints import failpoint
from vchan_assets.indexes import binary, sparse
from vchan_assets.indexes.params import for_segment
from vchan_assets.model import BINARY_METRICS, FieldIndex, FieldSchema, IndexType, MetricType, SegmentInfo
from vchan_assets.storage import Storage, StorageError
from vchan_assets.storage.layout import index_file_key
from vchan_assets.storage.rows import segment_vectors

INDEX_FILE = "index.faiss"


def engine_version() -> str:
    """The index engine of this process, recorded with every build."""
    return f"faiss-{faiss.__version__}"


class IndexBuildError(DeclaredError, RuntimeError):
    """A build failed (its segment's files unreadable, or faiss refused): the build is
    marked Failed with this message; nothing of it is visible."""

    build_id: int
    segment_id: int
    reason: str
    message = "index build {build_id} of segment {segment_id} failed: {reason}"


@dataclass(frozen=True)
class BuildSpec:
    """What one build needs; shipped to the Spark worker."""

    build_id: int
    version: int
    storage: Storage
    segment: SegmentInfo
    field: FieldSchema
    index: FieldIndex


@dataclass(frozen=True)
class BuildOutput:
    build_id: int
    files: tuple[str, ...]
    serialized_size: int
    rows: int
    engine_version: str
    seconds: float


def faiss_metric(metric: MetricType) -> int:
    return int(faiss.METRIC_L2 if metric is MetricType.L2 else faiss.METRIC_INNER_PRODUCT)


def prepared(vectors: np.ndarray, metric: MetricType) -> np.ndarray:
    """Vectors as faiss takes them: C-contiguous float32, normalized for COSINE; binary
    vectors (HAMMING, JACCARD) as their C-contiguous uint8 bytes."""
    if metric in BINARY_METRICS:
        return np.ascontiguousarray(vectors, dtype=np.uint8)
    out = np.array(vectors, dtype=np.float32, order="C", copy=True)
    if metric is MetricType.COSINE:
        faiss.normalize_L2(out)
    return out


def new_index(index: FieldIndex, dim: int, rows: int) -> Any:
    """An empty faiss index of the index's type for a segment of `rows` rows."""
    p = for_segment(index.type, index.params, dim, rows)
    if index.type is IndexType.BIN_IVF_FLAT:
        return binary.new_ivf(dim, p.nlist)
    metric = faiss_metric(index.metric)
    built: Any
    if index.type is IndexType.HNSW:
        built = faiss.IndexHNSWFlat(dim, p.M, metric)
        built.hnsw.efConstruction = p.ef_construction
        return built
    quantizer = faiss.IndexFlat(dim, metric)
    if index.type is IndexType.IVF_FLAT:
        built = faiss.IndexIVFFlat(quantizer, dim, p.nlist, metric)
    elif index.type is IndexType.IVF_PQ:
        built = faiss.IndexIVFPQ(quantizer, dim, p.nlist, p.m, p.nbits, metric)
    else:
        raise ValueError(f"{index.type} indexes are not built")
    return built  # (faiss's Python wrapper keeps the quantizer alive with the index)


def build(spec: BuildSpec, threads: int = 0) -> BuildOutput:
    """Build and write one segment's index; IndexBuildError if it cannot. `threads`: the
    OpenMP threads faiss uses on this thread (0: as many as cores). A build that runs beside
    others, each on its core (Spark tasks, the local engine's pool), takes one: faiss's
    threads spin while they wait, and oversubscribed cores make a build many times slower."""
    started = time.monotonic()
    if threads:
        faiss.omp_set_num_threads(threads)
    seg, field = spec.segment, spec.field
    try:
        if field.is_sparse:
            vectors: Any = sparse.segment_rows(spec.storage, seg, field)
        else:
            vectors = segment_vectors(spec.storage, seg, field)
    except (StorageError, pa.ArrowException, OSError) as exc:
        raise IndexBuildError(spec.build_id, seg.id, f"vectors unreadable: {exc}") from None
    rows = vectors.shape[0]
    if rows != seg.num_rows:
        reason = f"{rows} vectors in the binlogs of field {field.name!r}, the segment has {seg.num_rows} rows"
        raise IndexBuildError(spec.build_id, seg.id, reason)
    if field.is_sparse:
        drop = for_segment(spec.index.type, spec.index.params, 0, rows).drop_ratio_build
        blob = sparse.InvertedIndex.of(vectors, drop).to_bytes()
        name, engine = sparse.SPARSE_INDEX_FILE, sparse.engine_version()
    else:
        blob, name, engine = _faiss_blob(spec, vectors), INDEX_FILE, engine_version()
    key = index_file_key(spec.build_id, spec.version, name)
    try:
        spec.storage.write_atomic(key, pa.py_buffer(blob))
    except StorageError as exc:
        raise IndexBuildError(spec.build_id, seg.id, str(exc)) from None
    failpoint("index_built")  # in the builder (a Spark Python worker): file written, not returned
    return BuildOutput(spec.build_id, (key,), len(blob), rows, engine, time.monotonic() - started)


def _faiss_blob(spec: BuildSpec, vectors: np.ndarray) -> Any:
    """The faiss index of a segment's dense or binary vectors, serialized (a uint8 array)."""
    assert spec.field.dim is not None
    data = prepared(vectors, spec.index.metric)
    try:
        index = new_index(spec.index, spec.field.dim, len(data))
        if not index.is_trained:
            index.train(data)
        index.add(data)
        return binary.serialize(index) if spec.field.is_binary_vector else faiss.serialize_index(index)
    except RuntimeError as exc:  # faiss's C++ exceptions
        raise IndexBuildError(spec.build_id, spec.segment.id, f"faiss: {exc}") from None


def load_index(data: bytes, key: str = INDEX_FILE) -> Any:
    """The index of a file `key` from its bytes: a faiss index (a binary one too), or a
    sparse field's `InvertedIndex` (RuntimeError if they are not one)."""
    if key.endswith(sparse.SPARSE_INDEX_FILE):
        try:
            return sparse.InvertedIndex.from_bytes(data)
        except (ValueError, OSError, KeyError, EOFError) as exc:
            raise RuntimeError(f"not a sparse index file: {exc}") from None
    raw = np.frombuffer(data, dtype=np.uint8)
    return binary.deserialize(raw) if binary.is_serialized_binary(raw) else faiss.deserialize_index(raw)


# --- as Spark tasks ---------------------------------------------------------------------------

RESULT_SCHEMA = pa.schema([("build_id", pa.int64()), ("result", pa.binary())])


def build_pickled(spec: BuildSpec, threads: int = 0) -> dict[str, object]:
    """One build, its outcome (BuildOutput or IndexBuildError) pickled."""
    try:
        result: object = build(spec, threads)
    except IndexBuildError as exc:
        result = exc
    return {"build_id": spec.build_id, "result": pickle.dumps(result)}


def waves(count: int, cores: int) -> list[tuple[range, int]]:
    """How `count` builds share `cores`, as (the builds, faiss threads per build) run one
    wave after the other. Builds side by side with one thread each use the cores best (an
    HNSW or IVF build scales below linearly in its threads), so as long as they fill every
    core they run that way; the last `count % cores` builds, which would leave cores idle
    (3 builds on 2 cores: the third alone on one core), run side by side with the cores
    split between them. A lone build gets every core."""
    cores = max(1, cores)
    full = count - count % cores
    tail = count - full
    found = []
    if full:
        found.append((range(full), 1))
    if tail:
        found.append((range(full, count), max(1, cores // tail)))
    return found


def builds_arrow(
    specs: list[tuple[BuildSpec, int]], batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the input holds indices into `specs` (a build and its threads);
    each yields one row."""
    for batch in batches:
        for index in batch.column(0).to_pylist():
            spec, threads = specs[int(index)]
            yield pa.RecordBatch.from_pylist([build_pickled(spec, threads)], schema=RESULT_SCHEMA)


def build_here(specs: list[BuildSpec], cores: int | None = None) -> list[BuildOutput | IndexBuildError]:
    """The builds in this process, in `waves` over `cores` (this machine's by default),
    each wave's builds side by side on a thread each (faiss releases the GIL)."""
    cores = cores or os.cpu_count() or 1
    outcomes: dict[int, BuildOutput | IndexBuildError] = {}
    for builds, threads in waves(len(specs), cores):
        outcomes |= _side_by_side(specs, builds, threads, at_once=max(1, cores // threads))
    return [outcomes[i] for i in range(len(specs))]


def _side_by_side(
    specs: list[BuildSpec], builds: range, threads: int, at_once: int
) -> dict[int, BuildOutput | IndexBuildError]:
    """The `builds` (indices into `specs`), `at_once` at a time with `threads` each. The
    threads are daemons, not a ThreadPoolExecutor's, which the interpreter joins at exit: a
    DataCoord stopping (SIGTERM) with a batch in flight abandons it and exits at once."""
    outcomes: dict[int, BuildOutput | IndexBuildError] = {}
    errors: list[BaseException] = []
    pending = iter(builds)
    lock = threading.Lock()

    def builder() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            try:
                outcomes[i] = outcome_of(build_pickled(specs[i], threads))
            except BaseException as exc:  # raised in the caller's thread below
                errors.append(exc)
                return

    workers = [
        threading.Thread(target=builder, name=f"index build {n}", daemon=True)
        for n in range(min(len(builds), at_once))
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return outcomes


def outcome_of(row: dict[str, object]) -> BuildOutput | IndexBuildError:
    raw = row["result"]
    assert isinstance(raw, bytes)
    found = pickle.loads(raw)
    assert isinstance(found, BuildOutput | IndexBuildError)
    return found
