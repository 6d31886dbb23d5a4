"""HNSW builds and search over a collection against faiss alone (and Lance's IVF_PQ).

    .venv/bin/python -m bench.index_build [--rows 1000000] [--segments 10] [--queries 1000]

`--rows` clustered 128-d vectors (1,000 centers) in `--segments` sorted segments of one
vchannel (inserted, flushed, synced and sorted before anything is timed), an HNSW index
M=16, efConstruction=200. Measured in the same run, on the same vectors:

- build: our builds of the 10 segments (`IndexBuilder.run` on a warm local Spark session,
  what `index_step` runs: one Spark task per build, one faiss thread each, each segment's
  vectors read from its binlogs and its index file written and committed) against faiss
  building the same segments' indexes from numpy arrays in this process, one after the
  other, each with every core (`omp_set_num_threads(cores)`): ratio faiss / ours (>= 0.9
  is the target: ours at least 90% of faiss' speed). The two alternate in rounds of
  `cores` segments (ours, then faiss on the same segments), so both meet the same load on
  a shared machine; each round's times, ratio and load average are in the results;
- recall@10 of `Catalog.search` over the collection at the default search parameters
  (ef = 64) against exact search (faiss IndexFlatL2 over every vector);
- search throughput (queries/s, batches of `--batch` queries): `Catalog.search` against
  faiss searching the same per-segment index files loaded in this process (ef = 64) and
  merging the top 10, batch by batch in turn with ours: ratio ours / faiss (target >= 0.8);
- Lance (`pylance`, the optional `bench` extra; skipped when not installed): the same
  vectors written as a Lance dataset, `create_index` IVF_PQ (num_partitions sqrt(rows),
  16 sub-vectors) timed, searched one query at a time at its default parameters
  (recall@10, queries/s): the tool a user would pick for vectors in files.

Results: bench/results/index_build.json (or `--out`). Needs ~6 GB of memory at 1M rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pyarrow as pa

from bench import bench_stack
from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.indexes.build import load_index
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.params import default_ef
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    CollectionInfo,
    CollectionSchema,
    IndexType,
    SegmentIndexState,
    SegmentInfo,
    SegmentState,
)
from vchan_assets.query.index_checks import search_default
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

DIM = 128
CENTERS = 1000
M, EF_CONSTRUCTION, K = 16, 200, 10
SCHEMA = CollectionSchema.build("pk", {"vec": DIM}, {"n": "int64"})
BATCH = 50_000


def clustered(n: int, seed: int) -> np.ndarray:
    """`n` vectors around CENTERS fixed centers (unit spread around each)."""
    centers = np.random.default_rng(0).normal(0.0, 3.0, (CENTERS, DIM)).astype(np.float32)
    rng = np.random.default_rng(seed)
    return (centers[rng.integers(0, CENTERS, n)] + rng.normal(0.0, 1.0, (n, DIM))).astype(np.float32)


def load(
    system: System, vectors: np.ndarray, segments: int, schema: CollectionSchema = SCHEMA
) -> CollectionInfo:
    """A collection of one vchannel holding `vectors` (pk = row; a `vec` field of `schema`)
    in `segments` sorted segments."""
    producer = Producer(system)
    info = producer.create_collection(f"hnsw{uuid.uuid4().hex[:6]}", schema, num_channels=1)
    [vchannel] = info.vchannels
    per = math.ceil(len(vectors) / segments)
    started = time.perf_counter()
    for first in range(0, len(vectors), per):
        for start in range(first, min(first + per, len(vectors)), BATCH):
            end = min(start + BATCH, first + per, len(vectors))
            pks = np.arange(start, end, dtype=np.int64)
            producer.insert(info.name, {"pk": pks, "vec": vectors[start:end], "n": pks % 7})
        producer.flush(info.name)
        lease = system.store.read_lease(vchannel) or grant_channel_lease(
            system.store, IdAllocator(system.store), vchannel, 1
        )
        SyncTask(system, info, vchannel, lease, engine="local").run()
        print(
            f"  {min(first + per, len(vectors)):,} rows synced, {time.perf_counter() - started:.0f}s",
            flush=True,
        )
    sort_step(system, engine="local")
    print(f"  sorted, {time.perf_counter() - started:.0f}s", flush=True)
    return info


def sorted_segments(system: System, info: CollectionInfo) -> list[SegmentInfo]:
    found, _ = system.store.list_models(system.store.keys.segment.under(info.id), SegmentInfo)
    return sorted(
        (d.model for d in found if d.model.state is SegmentState.FLUSHED and d.model.is_sorted),
        key=lambda s: s.id,
    )


def segment_pks(catalog: Catalog, info: CollectionInfo, seg: SegmentInfo) -> np.ndarray:
    from vchan_assets.storage.rows import segment_rows

    return segment_rows(catalog.system.storage, seg, with_vectors=False)["pk"].to_numpy()


def faiss_builds(vectors: np.ndarray, pk_lists: list[np.ndarray]) -> float:
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    for pks in pk_lists:
        index = faiss.IndexHNSWFlat(DIM, M, faiss.METRIC_L2)
        index.hnsw.efConstruction = EF_CONSTRUCTION
        index.add(np.ascontiguousarray(vectors[pks]))
    return time.perf_counter() - started


def faiss_search(
    indexes: list[tuple[Any, np.ndarray]], queries: np.ndarray, kind: IndexType = IndexType.HNSW
) -> np.ndarray:
    """The top K pks over every segment's index (ef or nprobe as Catalog.search's default)."""
    distances, pks = [], []
    for index, seg_pks in indexes:
        d, p = search_default(index, queries, kind, K)
        distances.append(d)
        pks.append(np.where(p >= 0, seg_pks[np.maximum(p, 0)], -1))
    d, p = np.hstack(distances), np.hstack(pks)
    best = np.argsort(d, axis=1, kind="stable")[:, :K]
    return np.take_along_axis(p, best, axis=1)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(
        np.mean([len(set(f) & set(t)) / K for f, t in zip(found.tolist(), truth.tolist(), strict=True)])
    )


def per_second(n: int, seconds: float) -> float:
    return n / seconds if seconds else float("inf")


def catalog_search(
    catalog: Catalog, info: CollectionInfo, queries: np.ndarray, batch: int
) -> tuple[np.ndarray, float]:
    found = np.full((len(queries), K), -1, dtype=np.int64)
    started = time.perf_counter()
    for start in range(0, len(queries), batch):
        hits = catalog.search(info.name, queries[start : start + batch], k=K, as_arrow=True)
        q = hits["query"].to_numpy() + start
        rank = np.arange(len(q)) - np.searchsorted(q, q, side="left")
        found[q, rank] = hits["pk"].to_numpy()
    return found, time.perf_counter() - started


def lance_bench(vectors: np.ndarray, queries: np.ndarray, truth: np.ndarray) -> dict[str, Any]:
    try:
        import lance
    except ImportError:
        return {"skipped": "pylance is not installed (pip install '.[bench]')"}
    work = Path(tempfile.mkdtemp(prefix="vchan-lance-"))
    try:
        table = pa.table(
            {
                "pk": pa.array(np.arange(len(vectors), dtype=np.int64)),
                "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), DIM),
            }
        )
        dataset = lance.write_dataset(table, str(work / "vectors.lance"))
        partitions = max(1, int(math.sqrt(len(vectors))))
        started = time.perf_counter()
        dataset = dataset.create_index(
            "vector", index_type="IVF_PQ", num_partitions=partitions, num_sub_vectors=16, metric="L2"
        )
        build_s = time.perf_counter() - started
        found = np.full((len(queries), K), -1, dtype=np.int64)
        dataset.to_table(nearest={"column": "vector", "q": queries[0], "k": K}, columns=["pk"])  # warm
        started = time.perf_counter()
        for i, q in enumerate(queries):
            pks = dataset.to_table(nearest={"column": "vector", "q": q, "k": K}, columns=["pk"])["pk"]
            found[i, : len(pks)] = pks.to_numpy()
        search_s = time.perf_counter() - started
        return {
            "version": lance.__version__,
            "index": f"IVF_PQ num_partitions={partitions} num_sub_vectors=16",
            "build_s": round(build_s, 2),
            "recall_at_10": round(recall(found, truth), 4),
            "qps": round(per_second(len(queries), search_s), 1),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--segments", type=int, default=10)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=3600.0, help="the Spark build job's deadline")
    parser.add_argument("--lance", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default="bench/results/index_build.json")
    args = parser.parse_args()
    work, etcd, settings = bench_stack("vchan-hnsw-")
    try:
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        system = System(settings, MetaStore.connect(settings), storage)
        vectors = clustered(args.rows, seed=1)
        queries = clustered(args.queries, seed=2)
        print(f"loading {args.rows:,} x {DIM}-d vectors into {args.segments} segments", flush=True)
        info = load(system, vectors, args.segments)
        catalog = Catalog(system)
        segments = sorted_segments(system, info)
        pk_lists = [segment_pks(catalog, info, s) for s in segments]

        spark = get_spark(settings)  # warm: the JVM, and Python workers on every core
        spark.range(8, numPartitions=os.cpu_count() or 1).mapInArrow(lambda it: it, "id long").collect()
        create_index(system.store, info, "vec", "HNSW", "L2", {"M": M, "efConstruction": EF_CONSTRUCTION})
        builds_of = {b.model.segment_id: b.model.build_id for b in list_builds(system.store, info.id)}
        cores = os.cpu_count() or 1
        ours_s = faiss_s = task_s = 0.0
        built_rows = 0
        rounds: list[dict[str, float]] = []
        # In rounds of `cores` segments, ours then faiss on the same segments: both meet the
        # same load (the machine is shared; phases minutes apart measured different machines).
        for first in range(0, len(segments), cores):
            group = range(first, min(first + cores, len(segments)))
            started = time.perf_counter()
            report = IndexBuilder(system, "spark", timeout=args.timeout).run(
                build_ids={builds_of[segments[i].id] for i in group}
            )
            ours_round = time.perf_counter() - started
            assert not report.failed and len(report.finished) == len(group), report
            task_s += report.seconds
            built_rows += report.rows
            faiss_round = faiss_builds(vectors, [pk_lists[i] for i in group])
            ours_s, faiss_s = ours_s + ours_round, faiss_s + faiss_round
            rounds.append(
                {
                    "ours_s": round(ours_round, 2),
                    "faiss_s": round(faiss_round, 2),
                    "ratio": round(faiss_round / ours_round, 3),
                    "load_1m": round(os.getloadavg()[0], 1),
                }
            )
            print(
                f"  segments {first}-{group[-1]}: ours {ours_s:.1f}s, faiss alone {faiss_s:.1f}s (so far)",
                flush=True,
            )
        print(f"ours (Spark): {ours_s:.1f}s for {len(segments)} builds, {built_rows:,} rows", flush=True)
        print(f"faiss alone ({cores} threads): {faiss_s:.1f}s", flush=True)

        exact = faiss.IndexFlatL2(DIM)
        exact.add(vectors)
        _, truth = exact.search(queries, K)
        del exact
        builds = {b.model.segment_id: b.model for b in list_builds(system.store, info.id)}
        assert all(b.state is SegmentIndexState.FINISHED for b in builds.values())
        indexes = [
            (load_index(storage.read_bytes(builds[s.id].files[0])), pks)
            for s, pks in zip(segments, pk_lists, strict=True)
        ]
        catalog_search(catalog, info, queries[: args.batch], args.batch)  # warm: index files loaded
        # Batch by batch, ours then faiss on the same batch: both meet the same load.
        ours = np.full((len(queries), K), -1, dtype=np.int64)
        ours_search_s = faiss_search_s = 0.0
        for start in range(0, len(queries), args.batch):
            batch = queries[start : start + args.batch]
            found, seconds = catalog_search(catalog, info, batch, args.batch)
            ours[start : start + len(batch)] = found
            ours_search_s += seconds
            started = time.perf_counter()
            faiss_search(indexes, batch)
            faiss_search_s += time.perf_counter() - started
        alone = faiss_search(indexes, queries)
        result: dict[str, Any] = {
            "rows": args.rows,
            "dim": DIM,
            "segments": len(segments),
            "index": f"HNSW M={M} efConstruction={EF_CONSTRUCTION}",
            "cores": os.cpu_count(),
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores (shared)".strip(),
            "faiss": faiss.__version__,
            "build_ours_s": round(ours_s, 2),
            "build_ours_task_s_sum": round(task_s, 2),
            "build_faiss_s": round(faiss_s, 2),
            "build_ratio_faiss_over_ours": round(faiss_s / ours_s, 3),
            "build_rounds": rounds,
            "queries": args.queries,
            "batch": args.batch,
            "ef": default_ef(K),
            "recall_at_10_ours": round(recall(ours, truth), 4),
            "recall_at_10_faiss": round(recall(alone, truth), 4),
            "qps_ours": round(per_second(args.queries, ours_search_s), 1),
            "qps_faiss": round(per_second(args.queries, faiss_search_s), 1),
        }
        result["qps_ratio_ours_over_faiss"] = round(result["qps_ours"] / result["qps_faiss"], 3)
        if args.lance:
            print("lance IVF_PQ ...", flush=True)
            result["lance"] = lance_bench(vectors, queries, truth)
        print(json.dumps(result, indent=2), flush=True)
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
