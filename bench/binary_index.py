"""BIN_IVF_FLAT builds and HAMMING search over a collection of binary vectors against faiss
alone.

    .venv/bin/python -m bench.binary_index [--rows 200000] [--segments 4] [--dim 256]
                                           [--queries 10000] [--batches 100,1000] [--engine local]

`--rows` clustered `--dim`-bit vectors (1,000 centres, 8% of the bits flipped around each)
in `--segments` sorted segments of one vchannel (inserted as packed bytes, flushed, synced
and sorted before anything is timed), a BIN_IVF_FLAT index HAMMING at its default nlist
(4 * sqrt(rows of the segment)). Measured in the same run, on the same vectors:

- build: our builds of the segments (`IndexBuilder.run`, `--engine` local: the DataCoord's
  in-process builds, or spark; each segment's vectors read from its binlogs, its index
  trained, written with `serialize_index_binary` and committed) against faiss building the
  same segments' `IndexBinaryIVF` from numpy arrays in this process with every core:
  ratio faiss / ours. Ours and faiss alternate segment by segment, so both meet the same
  load on a shared machine;
- search throughput (queries/s, `--queries` in batches of each of `--batches`): `Catalog.search`
  (HAMMING, default nprobe) against faiss searching the same per-segment index files loaded
  in this process with the same nprobe and merging the top 10, batch by batch in turn with
  ours: ratio ours / faiss (target >= 0.8). Each call of ours also pays what a search at
  "now" reads of etcd (the collection, a timestamp, the segment listing) and the log tails,
  a fixed cost per call that faiss alone does not have: small batches show it;
- recall@10 of both against exact search (faiss `IndexBinaryFlat` over every vector),
  counting a hit found when it is as near as the 10th exact one (Hamming distances tie).

Results: bench/results/binary_index.json (or `--out`), with the load average before and
after.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

import faiss
import numpy as np

from bench import bench_parser, bench_system, write_report
from bench.index_build import load, per_second, segment_pks, sorted_segments
from vchan_assets.catalog import Catalog
from vchan_assets.indexes.build import load_index
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.params import default_nlist, default_nprobe
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.spark import Engine
from vchan_assets.system import System

CENTERS = 1000
FLIPPED = 0.08
K = 10
_FAISS: Any = faiss  # (its type stubs lack the search parameter classes)


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """`n` packed `dim`-bit vectors around CENTERS fixed centres, FLIPPED of their bits flipped."""
    centres = np.random.default_rng(0).integers(0, 2, (CENTERS, dim), dtype=np.uint8)
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim // 8), dtype=np.uint8)
    for start in range(0, n, 50_000):  # (bits unpacked a block at a time)
        m = min(50_000, n - start)
        bits = centres[rng.integers(0, CENTERS, m)] ^ (rng.random((m, dim)) < FLIPPED)
        out[start : start + m] = np.packbits(bits, axis=1)
    return out


def faiss_build(vectors: np.ndarray, dim: int) -> tuple[float, Any]:
    """faiss alone: the IndexBinaryIVF our build makes of these rows, with every core."""
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    index = faiss.IndexBinaryIVF(
        faiss.IndexBinaryFlat(dim), dim, min(default_nlist(len(vectors)), len(vectors) // 39)
    )
    index.train(vectors)
    index.add(vectors)
    return time.perf_counter() - started, index


def faiss_search(indexes: list[tuple[Any, np.ndarray]], queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The top K (distances, pks) over every segment's index at Catalog.search's default nprobe."""
    distances, pks = [], []
    for index, seg_pks in indexes:
        params = _FAISS.SearchParametersIVF()
        params.nprobe = default_nprobe(index.nlist)
        d, p = index.search(queries, K, params=params)
        distances.append(d)
        pks.append(np.where(p >= 0, seg_pks[np.maximum(p, 0)], -1))
    d, p = np.hstack(distances), np.hstack(pks)
    best = np.argsort(d, axis=1, kind="stable")[:, :K]
    return np.take_along_axis(d, best, axis=1), np.take_along_axis(p, best, axis=1)


def ours_search(catalog: Catalog, info: CollectionInfo, queries: np.ndarray) -> tuple[np.ndarray, float]:
    """Catalog.search's distances (queries x K) and its seconds."""
    started = time.perf_counter()
    hits = catalog.search(info.name, queries, k=K, as_arrow=True)
    seconds = time.perf_counter() - started
    found = np.full((len(queries), K), np.inf, dtype=np.float32)
    q = hits["query"].to_numpy()
    rank = np.arange(len(q)) - np.searchsorted(q, q, side="left")
    found[q, rank] = hits["distance"].to_numpy()
    return found, seconds


def tie_recall(found: np.ndarray, truth: np.ndarray) -> float:
    """The share of hits at most as far as their query's K-th exact hit."""
    return float((found <= truth[:, -1:]).sum() / found.size)


def builds(
    system: System, info: CollectionInfo, vectors: np.ndarray, engine: Engine, dim: int
) -> dict[str, float]:
    """Our build of each segment, then faiss's of the same rows: their seconds."""
    segments = sorted_segments(system, info)
    create_index(system.store, info, "vec", "BIN_IVF_FLAT", "HAMMING")
    builds_of = {b.model.segment_id: b.model.build_id for b in list_builds(system.store, info.id)}
    ours_s = faiss_s = 0.0
    for seg in segments:
        pks = segment_pks(Catalog(system), info, seg)
        started = time.perf_counter()
        report = IndexBuilder(system, engine).run(build_ids={builds_of[seg.id]})
        ours_s += time.perf_counter() - started
        assert not report.failed and len(report.finished) == 1, report
        faiss_s += faiss_build(np.ascontiguousarray(vectors[pks]), dim)[0]
    print(f"builds: ours {ours_s:.2f}s, faiss alone {faiss_s:.2f}s", flush=True)
    return {
        "build_ours_s": round(ours_s, 3),
        "build_faiss_s": round(faiss_s, 3),
        "build_ratio_faiss_over_ours": round(faiss_s / ours_s, 3),
    }


def searches(
    system: System,
    info: CollectionInfo,
    vectors: np.ndarray,
    queries: np.ndarray,
    batches: list[int],
    dim: int,
) -> dict[int, dict[str, float]]:
    """Catalog.search and faiss alone over the same index files, batch by batch in turn,
    for each batch size; the index files and the exact answers are loaded once."""
    catalog = Catalog(system)
    segments = sorted_segments(system, info)
    files = {b.model.segment_id: b.model.files[0] for b in list_builds(system.store, info.id)}
    indexes = [
        (load_index(system.storage.read_bytes(files[s.id])), segment_pks(catalog, info, s)) for s in segments
    ]
    exact = faiss.IndexBinaryFlat(dim)
    exact.add(vectors)
    truth, _ = exact.search(queries, K)
    ours_search(catalog, info, queries[: batches[0]])  # warm: index files loaded
    faiss_search(indexes, queries[: batches[0]])
    return {batch: batch_searches(catalog, info, indexes, queries, truth, batch) for batch in batches}


def batch_searches(
    catalog: Catalog,
    info: CollectionInfo,
    indexes: list[tuple[Any, np.ndarray]],
    queries: np.ndarray,
    truth: np.ndarray,
    batch: int,
) -> dict[str, float]:
    """Every query in batches of `batch`: ours, then faiss alone, batch by batch."""
    ours = np.full((len(queries), K), np.inf, dtype=np.float32)
    alone = np.full((len(queries), K), np.inf, dtype=np.float32)
    ours_s = faiss_s = 0.0
    for start in range(0, len(queries), batch):
        chunk = queries[start : start + batch]
        ours[start : start + len(chunk)], seconds = ours_search(catalog, info, chunk)
        ours_s += seconds
        started = time.perf_counter()
        alone[start : start + len(chunk)] = faiss_search(indexes, chunk)[0]
        faiss_s += time.perf_counter() - started
    qps_ours, qps_faiss = per_second(len(queries), ours_s), per_second(len(queries), faiss_s)
    print(f"batches of {batch}: ours {qps_ours:,.0f} queries/s, faiss alone {qps_faiss:,.0f}", flush=True)
    return {
        "recall_at_10_ours": round(tie_recall(ours, truth), 4),
        "recall_at_10_faiss": round(tie_recall(alone, truth), 4),
        "qps_ours": round(qps_ours, 1),
        "qps_faiss": round(qps_faiss, 1),
        "qps_ratio_ours_over_faiss": round(qps_ours / qps_faiss, 3),
    }


def main() -> None:
    parser = bench_parser(__doc__, 200_000, "bench/results/binary_index.json")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256, help="bits, a multiple of 8")
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--batches", default="100,1000", help="query batch sizes, comma-separated")
    parser.add_argument("--engine", choices=("local", "spark"), default="local")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    load_before = os.getloadavg()
    with bench_system("vchan-binary-") as (_, system):
        schema = CollectionSchema.build("pk", {"vec": f"binary_vector({args.dim})"}, {"n": "int64"})
        vectors = clustered(args.rows, args.dim, seed=1)
        queries = clustered(args.queries, args.dim, seed=2)
        print(f"loading {args.rows:,} x {args.dim}-bit vectors into {args.segments} segments", flush=True)
        info = load(system, vectors, args.segments, schema)
        report: dict[str, Any] = {
            "rows": args.rows,
            "dim_bits": args.dim,
            "segments": args.segments,
            "index": "BIN_IVF_FLAT HAMMING, default nlist and nprobe",
            "engine": args.engine,
            "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
            "faiss": faiss.__version__,
            "queries": args.queries,
            "batches": batches,
        }
        report |= builds(system, info, vectors, args.engine, args.dim)
        report["search"] = searches(system, info, vectors, queries, batches, args.dim)
    report["load_before"] = [round(x, 2) for x in load_before]
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=2), flush=True)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
