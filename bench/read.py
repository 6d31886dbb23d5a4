"""Reading a collection with deletes applied: Spark data source vs pandas reader vs pyarrow.

    .venv/bin/python -m bench.read [--rows 2000000] [--repeat 3]

N rows (int64 pk, a 32-d float32 vector, three scalars) in two vchannels, flushed as 6
segments per vchannel, 1% of the pks deleted. Measured in the same run on the same files:

- baseline: a plain pyarrow program — `pyarrow.dataset` scans of every insert binlog and delta
  log (all cores, pyarrow's own thread pool), then the same per-partition delete rule;
- `Catalog.read_collection` (pandas, one process);
- `format("vchan")` on a warm local Spark session (one task per segment), written to Spark's
  `noop` sink (every row and column read and converted, nothing collected), plus a count.

Reports seconds (median), rows/s, the ratios against the baseline and the peak RSS of the
driver process (ru_maxrss; the Spark JVM and workers are separate processes) at two sizes,
to show the driver's memory does not grow with the rows the executors read.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import pyarrow.dataset as ds

from bench import bench_stack
from bench.compaction import make_segments
from vchan_assets.catalog import Catalog
from vchan_assets.lifecycle.rows import apply_deletes_to
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
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


def measure(storage: Storage, catalog: Catalog, info: CollectionInfo, repeat: int) -> dict[str, Any]:
    segments = catalog.segment_infos(info.id)
    spark = get_spark(catalog.settings)
    result: dict[str, Any] = {
        "rows_in_binlogs": sum(s.num_rows for s in segments if s.level is SegmentLevel.L1)
    }
    base_s, base_rows = timed(lambda: baseline(storage, segments), repeat)
    pandas_s, pandas_rows = timed(lambda: len(catalog.read_collection(info.name)), repeat)
    before = peak_mb()

    def spark_read() -> int:
        df = catalog.spark_collection(info.name, spark=spark)
        df.write.format("noop").mode("overwrite").save()  # every row read, nothing collected
        return 0

    spark_s, _ = timed(spark_read, repeat)
    spark_rows = catalog.spark_collection(info.name, spark=spark).count()  # outside the timing
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
        catalog = Catalog(store, storage, settings)
        producer = Producer(store, storage, settings)
        results = []
        for rows in (args.rows // 4, args.rows):
            info = make_segments(producer, store, storage, settings, rows)
            result = measure(storage, catalog, info, args.repeat)
            results.append(result)
            print(
                f"{result['rows']:,} rows: pyarrow {result['pyarrow_s']:.2f}s, pandas reader "
                f"{result['pandas_s']:.2f}s, spark source {result['spark_s']:.2f}s "
                f"(pyarrow/spark {result['ratio_pyarrow_over_spark']:.2f}x); driver peak RSS "
                f"{result['driver_peak_mb_after_spark']:.0f} MB",
                flush=True,
            )
        print(json.dumps({"read": results}, default=str))
        store.close()
    finally:
        etcd.stop()


if __name__ == "__main__":
    main()
