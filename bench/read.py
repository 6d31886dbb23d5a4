"""Reading a collection with deletes applied: Spark data source vs pandas reader vs pyarrow.

    .venv/bin/python -m bench.read [--rows 2000000] [--repeat 3]

N rows (int64 pk, a 32-d float32 vector, three scalars) in two vchannels, flushed as 6
segments per vchannel, 1% of the pks deleted. Measured in the same run on the same files:

- baseline: a plain pyarrow program — `pyarrow.dataset` scans of every insert binlog and delta
  log (all cores, pyarrow's own thread pool), then the same per-partition delete rule;
- `Catalog.read_collection` (pandas, one process);
- `format("vchan")` on a local Spark session warmed by a count of the same collection (its
  Python workers started), written to Spark's `noop` sink (every row and column read and
  converted, nothing collected).

Reports seconds (median), rows/s, the ratios against the baseline, the peak RSS of the driver
process (ru_maxrss, which the pandas and pyarrow readers set: they hold the collection) and
its peak RSS while Spark reads (sampled; the Spark JVM and workers are separate processes)
at two sizes, to show the driver's memory does not grow with the rows the executors read;
and the 1-minute load average before and after each size (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow.dataset as ds

from bench import bench_stack
from bench.compaction import make_segments
from vchan_assets.catalog import Catalog
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import apply_deletes_to
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer


def baseline(storage: Storage, segments: list[SegmentInfo]) -> int:
    """The plain program: dataset scans of the binlogs, deletes applied per partition."""
    live = [s for s in segments if s.state is not SegmentState.DROPPED]
    kept = 0
    for partition in {s.partition_id for s in live}:
        rows_segs = [s for s in live if s.partition_id == partition and s.level is not SegmentLevel.L0]
        scalar_paths = [storage.path(b.path) for s in rows_segs for b in s.binlogs[0].logs]
        vector_paths = [storage.path(b.path) for s in rows_segs for g in s.binlogs[1:] for b in g.logs]
        delta_paths = [storage.path(b.path) for s in live if s.partition_id == partition for b in s.deltalogs]
        rows = ds.dataset(scalar_paths, format="parquet").to_table()
        vectors = ds.dataset(vector_paths, format="parquet").to_table()
        deletes = ds.dataset(delta_paths, format="parquet").to_table(columns=["pk", "timestamp"])
        rows = rows.append_column("vec", vectors["vec"])  # the groups are written aligned
        kept += apply_deletes_to(rows, deletes, "pk").num_rows
    return kept


def timed(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    runs, rows = [], 0
    for _ in range(repeat):
        started = time.perf_counter()
        rows = fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs), rows


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def peak_rss_during(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn()'s result and this process's peak RSS while it ran (sampled every 20 ms):
    ru_maxrss cannot tell, once the pandas reader has set it."""
    peak, done = [rss_mb()], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak.append(rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return fn(), max(peak)
    finally:
        done.set()
        sampler.join()


def measure(storage: Storage, catalog: Catalog, info: CollectionInfo, repeat: int) -> dict[str, Any]:
    segments = catalog.segment_infos(info.id)
    spark = get_spark(catalog.settings)
    result: dict[str, Any] = {
        "rows_in_binlogs": sum(s.num_rows for s in segments if s.level is SegmentLevel.L1)
    }
    load_before = os.getloadavg()[0]
    spark_rows = catalog.spark_collection(info.name, spark=spark).count()  # warms the workers, untimed
    base_s, base_rows = timed(lambda: baseline(storage, segments), repeat)
    pandas_s, pandas_rows = timed(lambda: len(catalog.read_collection(info.name)), repeat)
    before = peak_mb()

    def spark_read() -> int:
        df = catalog.spark_collection(info.name, spark=spark)
        df.write.format("noop").mode("overwrite").save()  # every row read, nothing collected
        return 0

    rss_before_spark = rss_mb()
    (spark_s, _), spark_peak = peak_rss_during(lambda: timed(spark_read, repeat))
    assert base_rows == pandas_rows == spark_rows, (base_rows, pandas_rows, spark_rows)
    result.update(
        rows=base_rows,
        pyarrow_s=base_s,
        pandas_s=pandas_s,
        spark_s=spark_s,
        pyarrow_rows_per_s=base_rows / base_s,
        pandas_rows_per_s=base_rows / pandas_s,
        spark_rows_per_s=base_rows / spark_s,
        ratio_pyarrow_over_spark=base_s / spark_s,
        ratio_pyarrow_over_pandas=base_s / pandas_s,
        driver_peak_mb_before_spark=round(before, 1),
        driver_peak_mb_after_spark=round(peak_mb(), 1),
        driver_rss_mb_before_spark=round(rss_before_spark, 1),
        driver_peak_mb_during_spark=round(spark_peak, 1),
        load_avg_1m=(round(load_before, 1), round(os.getloadavg()[0], 1)),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the larger collection")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work, etcd, settings = bench_stack("vchan-bench-read-")
    try:
        store = MetaStore.connect(settings)
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        catalog = Catalog(System(settings, store, storage))
        producer = Producer(System(settings, store, storage))
        results = []
        for rows in (args.rows // 4, args.rows):
            info = make_segments(producer, store, storage, settings, rows)
            result = measure(storage, catalog, info, args.repeat)
            results.append(result)
            print(
                f"{result['rows']:,} rows: pyarrow {result['pyarrow_s']:.2f}s, pandas reader "
                f"{result['pandas_s']:.2f}s, spark source {result['spark_s']:.2f}s "
                f"(pyarrow/spark {result['ratio_pyarrow_over_spark']:.2f}x); driver peak RSS "
                f"{result['driver_peak_mb_after_spark']:.0f} MB, {result['driver_peak_mb_during_spark']:.0f} MB "
                f"while Spark read; load {result['load_avg_1m']}",
                flush=True,
            )
        print(json.dumps({"read": results}, default=str))
        store.close()
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)  # gigabytes of binlogs at 10M rows


if __name__ == "__main__":
    main()
