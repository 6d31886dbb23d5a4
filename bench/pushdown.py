"""Point lookups with pushdown: one pk out of N rows in many segments.

    .venv/bin/python -m bench.pushdown [--rows 10000000] [--segments 50] [--lookups 5]

N rows (int64 pk, an 8-d vector, three scalars) over 2 vchannels, flushed as `--segments`
segments (each round of N/segments rows flushed and synced, 0.1% of its pks deleted).
For `--lookups` random pks, measured in the same run on the same files (median seconds):

- pushdown: `Catalog.read_collection(name, pks=[pk], with_vectors=False)`: segments pruned
  by their stats logs (pk range, then bloom filter), the kept ones read;
- full scan: `Catalog.read_collection(name, with_vectors=False)` then the pk selected in
  pandas (what a read without pushdown costs);
- pyarrow: `pyarrow.dataset` over every insert binlog of the scalar column group with
  `filter=pc.field("pk") == pk` (row-group statistics skip most of the data; no deletes
  applied, no log tail: less than the readers do);
- Spark: `format("vchan")` with `.option("pks", pk)` against `.filter(col("pk") == pk)` on a
  warm local session (the filter is applied after a full read: see the README's Pushdown).

Reports segments kept / total per lookup and the ratios full scan / pushdown and pyarrow /
pushdown (> 1: pushdown is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds

from bench import bench_stack
from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentLevel
from vchan_assets.query.prune import parse_where, prune
from vchan_assets.query.view import collection_views
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "f": "float", "s": "string"})
BATCH = 100_000


def build(system: System, rows: int, segments: int) -> CollectionInfo:
    producer = Producer(system)
    info = producer.create_collection(f"lookup{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    rounds = max(1, segments // len(info.vchannels))
    per = rows // rounds
    started = time.perf_counter()
    for r in range(rounds):
        for start in range(r * per, (r + 1) * per, BATCH):
            n = min(BATCH, (r + 1) * per - start)
            producer.insert(info.name, generate_rows(SCHEMA, n, start_pk=start, seed=start))
        producer.delete(info.name, list(range(r * per, (r + 1) * per, 1000)), partition="_default")
        producer.flush(info.name)
        for vchannel in info.vchannels:
            lease = system.store.read_lease(vchannel) or grant_channel_lease(
                system.store, IdAllocator(system.store), vchannel, 1
            )
            SyncTask(system, info, vchannel, lease, engine="local").run()
        print(
            f"  round {r + 1}/{rounds}: {(r + 1) * per:,} rows, {time.perf_counter() - started:.0f}s",
            flush=True,
        )
    return info


def median_s(fn: Callable[[int], Any], pks: list[int]) -> tuple[float, list[Any]]:
    times, results = [], []
    for pk in pks:
        started = time.perf_counter()
        results.append(fn(pk))
        times.append(time.perf_counter() - started)
    return statistics.median(times), results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--segments", type=int, default=50)
    parser.add_argument("--lookups", type=int, default=5)
    parser.add_argument("--spark", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default="bench/results/pushdown.json")
    args = parser.parse_args()
    work, etcd, settings = bench_stack("vchan-lookup-")
    try:
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        system = System(settings, MetaStore.connect(settings), storage)
        info = build(system, args.rows, args.segments)
        catalog = Catalog(system)
        served = [s for v in collection_views(system.store, info) for s in v.readable]
        rng = np.random.default_rng(1)
        pks = [int(p) for p in rng.integers(0, args.rows, args.lookups)]
        kept = [len(prune(system.storage, served, parse_where(info, [("pk", "=", pk)]))) for pk in pks]

        def pushdown(pk: int) -> int:
            return len(catalog.read_collection(info.name, pks=[pk], with_vectors=False))

        def full(pk: int) -> int:
            df = catalog.read_collection(info.name, with_vectors=False)
            return int((df["pk"] == pk).sum())

        scalar_files = [
            b.path
            for s in served
            if s.level is not SegmentLevel.L0
            for g in s.binlogs
            if g.group == 0
            for b in g.logs
        ]
        root = Path(settings.storage_uri)

        def pyarrow(pk: int) -> int:
            dataset = ds.dataset([str(root / p) for p in scalar_files], format="parquet")
            return dataset.to_table(filter=pc.field("pk") == pk, columns=["pk"]).num_rows

        result: dict[str, Any] = {"rows": args.rows, "segments": len(served), "lookups": pks, "kept": kept}
        for name, fn in (("pushdown", pushdown), ("full_scan", full), ("pyarrow_dataset", pyarrow)):
            seconds, found = median_s(fn, pks)
            result[f"{name}_s"] = seconds
            result[f"{name}_rows"] = found
            print(f"{name}: median {seconds:.3f}s, rows found {found}", flush=True)
        if args.spark:
            spark_df = catalog.spark_collection(info.name, with_vectors=False)
            spark_df.count()  # warm: JVM, Python workers
            seconds, found = median_s(
                lambda pk: catalog.spark_collection(info.name, with_vectors=False, pks=str(pk)).count(), pks
            )
            result.update(spark_pushdown_s=seconds, spark_pushdown_rows=found)
            seconds, found = median_s(lambda pk: spark_df.filter(spark_df.pk == pk).count(), pks)
            result.update(spark_filter_s=seconds, spark_filter_rows=found)
            print(f"spark: option pks {result['spark_pushdown_s']:.3f}s, filter {seconds:.3f}s", flush=True)
        result["full_over_pushdown"] = result["full_scan_s"] / result["pushdown_s"]
        result["pyarrow_over_pushdown"] = result["pyarrow_dataset_s"] / result["pushdown_s"]
        print(
            f"{len(served)} segments, kept per lookup {kept}; full scan / pushdown "
            f"{result['full_over_pushdown']:.1f}x, pyarrow dataset / pushdown {result['pyarrow_over_pushdown']:.2f}x"
        )
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    finally:
        etcd.stop()


if __name__ == "__main__":
    main()
