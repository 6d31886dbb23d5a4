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
from vchan_assets.indexes.params import for_segment
from vchan_assets.model import FieldIndex, FieldSchema, IndexType, MetricType, SegmentInfo
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
    """Vectors as faiss takes them: C-contiguous float32, normalized for COSINE."""
    out = np.array(vectors, dtype=np.float32, order="C", copy=True)
    if metric is MetricType.COSINE:
        faiss.normalize_L2(out)
    return out


def new_index(index: FieldIndex, dim: int, rows: int) -> Any:
    """An empty faiss index of the index's type for a segment of `rows` rows."""
    p = for_segment(index.type, index.params, dim, rows)
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
    assert field.dim is not None
    try:
        vectors = segment_vectors(spec.storage, seg, field)
    except (StorageError, pa.ArrowException, OSError) as exc:
        raise IndexBuildError(spec.build_id, seg.id, f"vectors unreadable: {exc}") from None
    if len(vectors) != seg.num_rows:
        reason = f"{len(vectors)} vectors in the binlogs of field {field.name!r}, the segment has {seg.num_rows} rows"
        raise IndexBuildError(spec.build_id, seg.id, reason)
    data = prepared(vectors, spec.index.metric)
    try:
        index = new_index(spec.index, field.dim, len(data))
        if not index.is_trained:
            index.train(data)
        index.add(data)
        blob = faiss.serialize_index(index)
    except RuntimeError as exc:  # faiss's C++ exceptions
        raise IndexBuildError(spec.build_id, seg.id, f"faiss: {exc}") from None
    key = index_file_key(spec.build_id, spec.version, INDEX_FILE)
    try:
        spec.storage.write_atomic(key, pa.py_buffer(blob))
    except StorageError as exc:
        raise IndexBuildError(spec.build_id, seg.id, str(exc)) from None
    failpoint("index_built")  # in the builder (a Spark Python worker): file written, not returned
    return BuildOutput(
        spec.build_id, (key,), int(blob.nbytes), len(data), engine_version(), time.monotonic() - started
    )


def load_index(data: bytes) -> Any:
    """A faiss index from its serialized bytes (RuntimeError if they are not one)."""
    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))


# --- as Spark tasks ---------------------------------------------------------------------------

RESULT_SCHEMA = pa.schema([("build_id", pa.int64()), ("result", pa.binary())])


def build_pickled(spec: BuildSpec, threads: int = 0) -> dict[str, object]:
    """One build, its outcome (BuildOutput or IndexBuildError) pickled."""
    try:
        result: object = build(spec, threads)
    except IndexBuildError as exc:
        result = exc
    return {"build_id": spec.build_id, "result": pickle.dumps(result)}


def builds_arrow(specs: list[BuildSpec], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the input holds build indices; each yields one row. A Spark task
    has one core, so its build takes one thread."""
    for batch in batches:
        for index in batch.column(0).to_pylist():
            yield pa.RecordBatch.from_pylist([build_pickled(specs[int(index)], 1)], schema=RESULT_SCHEMA)


def build_here(specs: list[BuildSpec]) -> list[BuildOutput | IndexBuildError]:
    """The builds in this process: one alone with every core, several side by side on a
    thread each (faiss releases the GIL), as many at once as there are cores. The threads
    are daemons, not a ThreadPoolExecutor's, which the interpreter joins at exit: a
    DataCoord stopping (SIGTERM) with a batch in flight abandons it and exits at once."""
    if len(specs) == 1:
        return [outcome_of(build_pickled(specs[0]))]
    outcomes: list[BuildOutput | IndexBuildError | None] = [None] * len(specs)
    errors: list[BaseException] = []
    pending = iter(range(len(specs)))
    lock = threading.Lock()

    def builder() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            try:
                outcomes[i] = outcome_of(build_pickled(specs[i], 1))
            except BaseException as exc:  # raised in the caller's thread below
                errors.append(exc)
                return

    threads = [
        threading.Thread(target=builder, name=f"index build {n}", daemon=True)
        for n in range(min(len(specs), os.cpu_count() or 1))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [o for o in outcomes if o is not None]


def outcome_of(row: dict[str, object]) -> BuildOutput | IndexBuildError:
    raw = row["result"]
    assert isinstance(raw, bytes)
    found = pickle.loads(raw)
    assert isinstance(found, BuildOutput | IndexBuildError)
    return found
