"""Sparse inverted index builds and search over a collection against scipy.sparse alone.

    .venv/bin/python -m bench.sparse_index [--rows 200000] [--segments 4] [--queries 200]

`--rows` SPLADE-like sparse rows (about `--nonzeros` 150 indices of a 30,000 vocabulary,
Zipf-like: low indices frequent, as a text model's tokens) in `--segments` sorted segments
of one vchannel (inserted, flushed, synced and sorted before anything is timed), a
SPARSE_INVERTED_INDEX (metric IP, no drop ratio). Measured in the same run, on the same
rows:

- build: our builds (`IndexBuilder.run`, local engine: each segment's sparse column read
  from its binlogs, its posting lists built, its `.npz` file written and committed in etcd)
  against two plain programs on the same segments: scipy alone building the posting lists
  (the CSR of the transposed rows) from the CSR matrices in memory (the index's own cost),
  and the same job done plainly end to end: pyarrow reading the segment's sparse binlog,
  scipy building the posting lists, `scipy.sparse.save_npz` writing them (ratio
  plain / ours: the build's baseline). Segment by segment, ours then theirs, so all meet
  the same load on a shared machine.
- search: `Catalog.search` (query view, pk and timestamp columns, deletes, log tail, the
  index files, merge) against scipy alone (each segment's posting lists in memory,
  Q @ postings, a top-k per query and a merge of the segments' top k), batch by batch in
  turn: queries/s and ratio ours / scipy (target >= 0.8); the hits of both compared
  (the same pks: the index is exact without drop ratios).

Results: bench/results/sparse_index.json (or `--out`).
"""

from __future__ import annotations

import io
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import scipy
import scipy.sparse as sp

from bench import bench_parser, bench_system, write_report
from bench.index_build import K, catalog_search, load, sorted_segments
from vchan_assets import fields
from vchan_assets.catalog import Catalog
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.model import CollectionSchema, SegmentInfo
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import segment_rows

VOCABULARY = 30_000
SCHEMA = CollectionSchema.build("pk", {"sv": "sparse_float_vector"}, {"n": "int64"})


def splade_like(n: int, nonzeros: int, seed: int) -> pa.MapArray:
    return fields.random_sparse(np.random.default_rng(seed), n, VOCABULARY, nonzeros)


def as_csr(column: pa.MapArray) -> sp.csr_array:
    offsets, indices, values = fields.sparse_buffers(column)
    return sp.csr_array((values, indices, offsets), shape=(len(column), VOCABULARY))


def scipy_postings(rows: sp.csr_array) -> sp.csr_array:
    """scipy alone: the posting lists of `rows` (terms x rows), its CSC transposed."""
    return sp.csr_array(rows.T)


def plain_build(storage: Storage, seg: SegmentInfo, field: str, vocabulary: int, out: Path) -> None:
    """The job done plainly: the segment's sparse binlog read with pyarrow, its posting lists
    built with scipy, written with scipy's npz."""
    group = next(g for g in seg.binlogs if SCHEMA.field(field).field_id in g.field_ids)
    column = pa.concat_tables([storage.read_parquet(b.path, columns=[field]) for b in group.logs])[field]
    offsets, indices, values = fields.sparse_buffers(column)
    rows = sp.csr_array((values, indices.astype(np.int32), offsets), shape=(len(column), vocabulary))
    buffer = io.BytesIO()
    sp.save_npz(buffer, scipy_postings(rows), compressed=False)  # as ours: np.savez
    out.write_bytes(buffer.getvalue())


def scipy_search(postings: list[tuple[sp.csr_array, np.ndarray]], queries: sp.csr_array) -> np.ndarray:
    """The top K pks per query over every segment: Q @ postings, the k best of each
    segment's nonzero scores, merged."""
    scores, pks = [], []
    for matrix, seg_pks in postings:
        product = sp.csr_array(queries @ matrix)
        best_s = np.full((queries.shape[0], K), -np.inf, dtype=np.float32)
        best_p = np.full((queries.shape[0], K), -1, dtype=np.int64)
        for q in range(queries.shape[0]):
            start, end = product.indptr[q], product.indptr[q + 1]
            found, rows = product.data[start:end], product.indices[start:end]
            take = min(K, len(found))
            if take:
                top = np.argpartition(-found, take - 1)[:take]
                best_s[q, :take], best_p[q, :take] = found[top], seg_pks[rows[top]]
        scores.append(best_s)
        pks.append(best_p)
    s, p = np.hstack(scores), np.hstack(pks)
    order = np.argsort(-s, axis=1, kind="stable")
    return np.take_along_axis(p, order[:, :K], axis=1)


def same_hits(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([set(x) == set(y) for x, y in zip(a.tolist(), b.tolist(), strict=True)]))


def main() -> None:
    parser = bench_parser(__doc__, rows=200_000, out="bench/results/sparse_index.json")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--nonzeros", type=int, default=150)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--query-nonzeros", type=int, default=30)
    parser.add_argument("--batch", type=int, default=50)
    args = parser.parse_args()
    with bench_system("vchan-sparse-") as (_, system):
        column = splade_like(args.rows, args.nonzeros, seed=1)
        queries = splade_like(args.queries, args.query_nonzeros, seed=2)
        matrix = as_csr(column)
        print(f"loading {args.rows:,} sparse rows ({matrix.nnz / args.rows:.0f} indices a row)", flush=True)
        info = load(system, column, args.segments, SCHEMA, "sv")
        segments = sorted_segments(system, info)
        pk_lists = [segment_rows(system.storage, s, with_vectors=False)["pk"].to_numpy() for s in segments]

        create_index(system.store, info, "sv", "SPARSE_INVERTED_INDEX", "IP")
        builds_of = {b.model.segment_id: b.model.build_id for b in list_builds(system.store, info.id)}
        ours_s = scipy_s = plain_s = 0.0
        scratch = Path(tempfile.mkdtemp(prefix="vchan-sparse-plain-"))
        rounds: list[dict[str, float]] = []
        postings = []
        for seg, pks in zip(segments, pk_lists, strict=True):
            started = time.perf_counter()
            report = IndexBuilder(system, "local").run(build_ids={builds_of[seg.id]})
            ours_round = time.perf_counter() - started
            assert not report.failed and len(report.finished) == 1, report
            rows = sp.csr_array(matrix[pks])  # (not timed: scipy alone starts from memory)
            started = time.perf_counter()
            postings.append((scipy_postings(rows), pks))
            scipy_round = time.perf_counter() - started
            started = time.perf_counter()
            plain_build(system.storage, seg, "sv", VOCABULARY, scratch / f"{seg.id}.npz")
            plain_round = time.perf_counter() - started
            ours_s, scipy_s, plain_s = ours_s + ours_round, scipy_s + scipy_round, plain_s + plain_round
            rounds.append(
                {
                    "rows": len(pks),
                    "ours_s": round(ours_round, 3),
                    "scipy_s": round(scipy_round, 3),
                    "plain_s": round(plain_round, 3),
                    "load_1m": round(os.getloadavg()[0], 1),
                }
            )
            print(
                f"  segment {seg.id}: ours {ours_round:.2f}s, plain read+build+write {plain_round:.2f}s, "
                f"scipy alone in memory {scipy_round:.2f}s",
                flush=True,
            )

        catalog = Catalog(system)
        catalog_search(catalog, info, queries.slice(0, args.batch), args.batch)  # warm: index files loaded
        query_matrix = as_csr(queries)
        ours = np.full((args.queries, K), -1, dtype=np.int64)
        alone = np.full((args.queries, K), -1, dtype=np.int64)
        ours_search_s = scipy_search_s = 0.0
        for start in range(0, args.queries, args.batch):
            size = min(args.batch, args.queries - start)
            found, seconds = catalog_search(catalog, info, queries.slice(start, size), args.batch)
            ours[start : start + size] = found
            ours_search_s += seconds
            started = time.perf_counter()
            alone[start : start + size] = scipy_search(
                postings, sp.csr_array(query_matrix[start : start + size])
            )
            scipy_search_s += time.perf_counter() - started
        result: dict[str, Any] = {
            "rows": args.rows,
            "indices_per_row": round(matrix.nnz / args.rows, 1),
            "vocabulary": VOCABULARY,
            "segments": len(segments),
            "index": "SPARSE_INVERTED_INDEX IP",
            "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
            "scipy": scipy.__version__,
            "build_ours_s": round(ours_s, 2),
            "build_scipy_s": round(scipy_s, 2),
            "build_ratio_scipy_over_ours": round(scipy_s / ours_s, 3),
            "build_plain_s": round(plain_s, 2),
            "build_ratio_plain_over_ours": round(plain_s / ours_s, 3),
            "build_rounds": rounds,
            "queries": args.queries,
            "query_indices": args.query_nonzeros,
            "batch": args.batch,
            "qps_ours": round(args.queries / ours_search_s, 1),
            "qps_scipy": round(args.queries / scipy_search_s, 1),
            "same_hits_share": round(same_hits(ours, alone), 4),
            "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
        }
        result["qps_ratio_ours_over_scipy"] = round(result["qps_ours"] / result["qps_scipy"], 3)
        print(json.dumps(result, indent=2), flush=True)
        write_report(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
