"""Batch search in Spark: one task per segment against one task per slice of the queries.

    .venv/bin/python -m bench.batch_search [--rows 200000] [--segments 10] [--queries 2000]

`--rows` clustered 128-d vectors (bench.index_build's data) in `--segments` sorted segments
of one vchannel, an HNSW index (M=16, efConstruction=100) built before anything is timed.
Then, on a warm local Spark session, in the same run and alternating, `--repeat` times
each: `query.batch_search.search_table` with `by="segment"` (one Spark task per segment,
all queries) and `by="query"` (one task per slice of the queries, as many as Spark's
default parallelism, all segments), and `Catalog.search` in this process for reference.
Each run is checked to return the same hits as `Catalog.search`. The first run of each
distribution loads the index files into the Python workers (cold); later runs may find
them in a worker's cache (warm: a worker keeps up to 32 loaded indexes).

Results: bench/results/batch_search.json (or `--out`).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

import numpy as np
import pandas as pd

from bench import bench_system, write_report
from bench.index_build import DIM, K, clustered, load
from vchan_assets.catalog import Catalog
from vchan_assets.indexes.meta import create_index
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.query.batch_search import search_table
from vchan_assets.query.spark_source import spark_session


def hits_of(table: Any, id_column: str = "query") -> list[tuple[int, int]]:
    return sorted(zip(table[id_column].to_pylist(), table["pk"].to_pylist(), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--segments", type=int, default=10)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="bench/results/batch_search.json")
    args = parser.parse_args()
    with bench_system("vchan-batch-search-") as (_work, system):
        vectors = clustered(args.rows, seed=1)
        queries = clustered(args.queries, seed=2)
        print(f"loading {args.rows:,} x {DIM}-d vectors into {args.segments} segments", flush=True)
        info = load(system, vectors, args.segments)
        create_index(system.store, info, "vec", "HNSW", "L2", {"M": 16, "efConstruction": 100})
        started = time.perf_counter()
        report = IndexBuilder(system, "local").run(collection_id=info.id)
        assert not report.failed and len(report.finished) == args.segments, report
        print(f"  built {len(report.finished)} indexes in {time.perf_counter() - started:.0f}s", flush=True)

        spark = spark_session(system)
        cores = os.cpu_count() or 1
        spark.range(8, numPartitions=cores).mapInArrow(lambda it: it, "id long").collect()  # warm
        frame = spark.createDataFrame(
            pd.DataFrame({"query": np.arange(len(queries)), "vector": [q.tolist() for q in queries]})
        ).cache()
        frame.count()
        catalog = Catalog(system)
        expected = catalog.search(info.name, queries, k=K, as_arrow=True)
        seconds: dict[str, list[float]] = {"segment": [], "query": [], "catalog": []}
        for attempt in range(args.repeat):
            for by in ("segment", "query"):
                started = time.perf_counter()
                found = search_table(system, info, frame, k=K, by=by)
                seconds[by].append(time.perf_counter() - started)
                assert hits_of(found) == hits_of(expected), f"by {by}: other hits than Catalog.search"
                print(f"  run {attempt + 1} by {by}: {seconds[by][-1]:.2f}s", flush=True)
            started = time.perf_counter()
            catalog.search(info.name, queries, k=K, as_arrow=True)
            seconds["catalog"].append(time.perf_counter() - started)
            print(f"  run {attempt + 1} Catalog.search: {seconds['catalog'][-1]:.2f}s", flush=True)
        result: dict[str, Any] = {
            "rows": args.rows,
            "dim": DIM,
            "segments": args.segments,
            "queries": args.queries,
            "k": K,
            "index": "HNSW M=16 efConstruction=100, ef 64 (default)",
            "machine": f"{platform.machine()} {cores} cores (shared)",
            "load_avg": os.getloadavg(),
            "by_segment_s": [round(s, 2) for s in seconds["segment"]],
            "by_query_s": [round(s, 2) for s in seconds["query"]],
            "catalog_search_s": [round(s, 2) for s in seconds["catalog"]],
            "ratio_query_over_segment_best": round(min(seconds["query"]) / min(seconds["segment"]), 3),
        }
        print(result, flush=True)
        write_report(args.out, result)


if __name__ == "__main__":
    main()
