"""Benchmark of the sync path: log -> binlogs with Spark, against a pyarrow baseline.

    .venv/bin/python -m bench.sync [--sizes 1000000,3000000] [--repeat 3]

For each size it generates a log of N rows (int64 pk, int64 ts, a 128-d float32
vector, three scalars) in one vchannel, then measures in the same run:
  - baseline: plain pyarrow in one process reads the same log files and writes the same
    binlogs (column groups, split by segment, same writer settings, same atomic writes);
  - sync (spark): the real SyncTask on a warm local Spark session, commit included;
  - sync (local): the same task code in-process, without Spark (to show Spark's share).
Each sync runs on a fresh copy of the channel's meta (new collection, same rows).
Reports seconds (median), rows/s, MB/s of log read, the ratio baseline/sync
(>= 1 means the sync is faster) and peak RSS of the process tree during the sync.
Also the fixed cost of a 1,000-row sync on a warm session.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench import bench_stack
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.binlog_writer import column_groups, take_rows, write_parquet
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.wal.format import MsgType
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader

SCHEMA = CollectionSchema.build("pk", {"vec": 128}, {"n": "int64", "f": "float", "s": "string"})
BATCH = 100_000


class PeakRss:
    """Samples the RSS of this process and all its descendants (JVM, Python workers)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = 0
        self.peak_workers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total, workers = me.memory_info().rss, 0
            for child in me.children(recursive=True):
                try:
                    rss = child.memory_info().rss
                    total += rss
                    if "python" in child.name():
                        workers += rss
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)
            self.peak_workers = max(self.peak_workers, workers)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def baseline(storage: Storage, info: CollectionInfo, vchannel: str, out_prefix: str) -> int:
    """The simplest pyarrow program doing the same work: returns rows written."""
    groups = column_groups(info.schema)
    rows = 0
    log_id = 0
    for f in WalReader(storage, vchannel, info).files():
        table = pq.read_table(storage.path(f.key))
        is_insert = pc.equal(table["msg_type"], MsgType.INSERT.value).to_numpy(zero_copy_only=False)
        segment_ids = table["segment_id"].fill_null(-1).to_numpy()
        for seg in np.unique(segment_ids[is_insert]).tolist():
            part = take_rows(table, is_insert & (segment_ids == seg))
            for group, columns in groups:
                log_id += 1
                key = f"{out_prefix}/{seg}/{group}/{log_id}.parquet"
                write_parquet(storage, key, part.select(columns), vector=group != 0)
            rows += part.num_rows
    return rows


def make_log(producer: Producer, rows: int) -> CollectionInfo:
    name = f"bench{uuid.uuid4().hex[:8]}"
    info = producer.create_collection(name, SCHEMA, num_channels=1)
    for start in range(0, rows, BATCH):
        producer.insert(name, generate_rows(SCHEMA, min(BATCH, rows - start), start_pk=start, seed=start))
    return info


def reset_channel(store: MetaStore, storage: Storage, info: CollectionInfo) -> None:
    """Forget every sync of the collection: its segment meta, checkpoint and binlogs,
    so the next sync starts from the beginning of the same log."""
    store.delete_prefix(store.keys.segments(info.id))
    store.delete(store.keys.channel_checkpoint(info.vchannels[0]))
    for root in ("insert_log", "delta_log", "stats_log"):
        storage.filesystem.delete_dir_contents(storage.path(root), missing_dir_ok=True)


def timed_sync(
    store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo, engine: str
) -> dict[str, Any]:
    vchannel = info.vchannels[0]
    lease = grant_channel_lease(store, IdAllocator(store), vchannel, node_id=1)
    with PeakRss() as rss:
        started = time.perf_counter()
        result = SyncTask(store, storage, settings, info, vchannel, lease, engine=engine).run()  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "rows": result.rows,
        "peak_rss_mb": rss.peak / 2**20,
        "workers_rss_mb": rss.peak_workers / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000000,3000000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="bench/results/sync.json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    work, etcd, settings = bench_stack()
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    producer = Producer(store, storage, settings)
    report: dict[str, Any] = {"sizes": {}, "spark_partitions": settings.spark_partitions}
    try:
        spark = get_spark(settings)
        report["spark"] = spark.version
        warm = make_log(producer, 1000)
        timed_sync(store, storage, settings, warm, "spark")  # JVM and Python workers warm

        fixed = []
        for _ in range(5):
            small = make_log(producer, 1000)
            fixed.append(timed_sync(store, storage, settings, small, "spark")["seconds"])
        report["sync_1000_rows_warm_s"] = statistics.median(fixed)
        print(
            f"1,000-row sync, warm Spark: median {statistics.median(fixed):.3f}s of {[round(x, 3) for x in fixed]}"
        )

        for size in sizes:
            info = make_log(producer, size)
            log_bytes = sum(f.size_bytes for f in WalReader(storage, info.vchannels[0], info).files())
            runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "spark": [], "local": []}
            for i in range(args.repeat):
                started = time.perf_counter()
                with PeakRss() as rss:
                    rows = baseline(storage, info, info.vchannels[0], f"baseline/{size}/{i}")
                runs["baseline"].append(
                    {"seconds": time.perf_counter() - started, "rows": rows, "peak_rss_mb": rss.peak / 2**20}
                )
                for engine in ("spark", "local"):
                    reset_channel(store, storage, info)
                    runs[engine].append(timed_sync(store, storage, settings, info, engine))
            summary = {}
            for name, measured in runs.items():
                secs = statistics.median(m["seconds"] for m in measured)
                summary[name] = {
                    "median_s": secs,
                    "runs_s": [round(m["seconds"], 3) for m in measured],
                    "rows_per_s": size / secs,
                    "log_mb_per_s": log_bytes / 2**20 / secs,
                    "peak_rss_mb": max(m["peak_rss_mb"] for m in measured),
                }
                assert all(m["rows"] == size for m in measured), f"{name} persisted a different row count"
            summary["ratio_spark_vs_baseline"] = (
                summary["baseline"]["median_s"] / summary["spark"]["median_s"]
            )
            summary["ratio_local_vs_baseline"] = (
                summary["baseline"]["median_s"] / summary["local"]["median_s"]
            )
            summary["log_mb"] = log_bytes / 2**20
            report["sizes"][size] = summary
            print(f"\n{size:,} rows, log {log_bytes / 2**20:.0f} MB")
            for name in ("baseline", "spark", "local"):
                s = summary[name]
                print(
                    f"  {name:9s} {s['median_s']:6.2f}s  {s['rows_per_s'] / 1e6:5.2f}M rows/s  "
                    f"{s['log_mb_per_s']:6.0f} MB/s  peak RSS {s['peak_rss_mb']:6.0f} MB  runs {s['runs_s']}"
                )
            print(f"  ratio sync(spark)/baseline throughput: {summary['ratio_spark_vs_baseline']:.2f}")
            # Files of earlier sizes are not needed any more.
            storage.filesystem.delete_dir_contents(storage.path("baseline"), missing_dir_ok=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"\nwritten {args.out}")
    finally:
        store.close()
        etcd.stop()


if __name__ == "__main__":
    main()
