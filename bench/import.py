"""Benchmark of bulk import.

    .venv/bin/python -m bench.import [--rows 10000000] [--files 8] [--small 2500000]

N rows (int64 pk, a 128-d float32 vector as fixed_size_list, three scalars) in `--files`
Parquet files. Measured in the same run on the same files:
  - baseline: a plain pyarrow program using all cores (a thread per file, pyarrow's own
    pool inside) that reads each file in batches, converts the vectors to the binlog type,
    adds row id and timestamp, routes rows to the vchannels by pk and streams the same
    column groups (scalar group, vector group) per vchannel with the same writer settings;
  - import: `vchan_assets.imports` end to end (pre-import of every file, one Spark task
    per file on a warm local Spark session, stats logs, the etcd commits).
Reports seconds, rows/s, the ratio baseline/import (>= 1: the import is faster) and the
peak RSS of the process tree (driver, JVM, Python workers) during each import, at N rows
and at `--small` rows, to show memory is flat in the rows imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import bench_stack, write_report
from bench.sync import PeakRss
from vchan_assets import imports
from vchan_assets.config import Settings
from vchan_assets.datanode.binlog_writer import column_groups
from vchan_assets.imports.executor import ImportExecutor
from vchan_assets.imports.jobs import ImportState
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

DIM = 128
SCHEMA = CollectionSchema.build("pk", {"vec": DIM}, {"n": "int64", "f": "float", "s": "string"})
CHUNK = 100_000


def make_files(directory: Path, rows: int, files: int) -> list[str]:
    """`files` Parquet files of `rows` rows in all, written chunk by chunk."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    per = rows // files
    for i in range(files):
        path = directory / f"part-{i:03d}.parquet"
        with pq.ParquetWriter(path, _input_schema()) as writer:
            for start in range(i * per, (i + 1) * per, CHUNK):
                n = min(CHUNK, (i + 1) * per - start)
                writer.write_table(_chunk(rng, start, n))
        paths.append(str(path))
    return paths


def _input_schema() -> pa.Schema:
    return pa.schema(
        [
            ("pk", pa.int64()),
            ("vec", pa.list_(pa.float32(), DIM)),
            ("n", pa.int64()),
            ("f", pa.float32()),
            ("s", pa.string()),
        ]
    )


def _chunk(rng: np.random.Generator, start: int, n: int) -> pa.Table:
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * DIM, dtype=np.float32)), DIM)
    words = pa.array([f"tag_{i}" for i in range(100)]).take(pa.array(rng.integers(0, 100, n)))
    return pa.Table.from_arrays(
        [
            pa.array(np.arange(start, start + n, dtype=np.int64)),
            vectors,
            pa.array(rng.integers(0, 1_000_000, n)),
            pa.array(rng.random(n, dtype=np.float32)),
            words,
        ],
        schema=_input_schema(),
    )


def baseline(paths: list[str], out: Path, channels: int) -> int:
    """The plain program: per file (a thread each), batches -> binlog types -> per-channel
    column-group files, streamed with the binlog writer's settings."""
    groups = column_groups(SCHEMA)
    ts = 1 << 40

    def one(index_path: tuple[int, str]) -> int:
        index, path = index_path
        writers: dict[tuple[int, int], pq.ParquetWriter] = {}
        row_id = index << 32
        rows = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=64 * 1024):
            n = batch.num_rows
            flat = batch.column("vec").flatten().to_numpy()
            vec = pa.FixedSizeBinaryArray.from_buffers(pa.binary(DIM * 4), n, [None, pa.py_buffer(flat)])
            table = pa.table(
                {
                    "offset": np.arange(row_id, row_id + n, dtype=np.int64),
                    "timestamp": np.full(n, ts, dtype=np.int64),
                    "pk": batch.column("pk"),
                    "n": batch.column("n"),
                    "f": batch.column("f"),
                    "s": batch.column("s"),
                    "vec": vec,
                }
            )
            row_id += n
            channel = np.mod(table["pk"].to_numpy(), channels)
            for c in range(channels):
                part = table.filter(pa.array(channel == c))
                for group, columns in groups:
                    piece = part.select(columns).rename_columns(["row_id", *columns[1:]])
                    writer = writers.get((c, group))
                    if writer is None:
                        vector = group != 0
                        writer = writers[(c, group)] = pq.ParquetWriter(
                            out / f"{index}-{c}-{group}.parquet",
                            piece.schema,
                            compression="none" if vector else "snappy",
                            use_dictionary=not vector,
                            write_statistics=not vector,
                        )
                    writer.write_table(piece)
            rows += n
        for writer in writers.values():
            writer.close()
        return rows

    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return sum(pool.map(one, enumerate(paths)))


def run_import(
    store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo, paths: list[str]
) -> tuple[float, int, PeakRss]:
    """(seconds, rows imported, peak RSS: process tree and Python workers) of one import job on Spark."""
    with PeakRss() as peak:
        started = time.perf_counter()
        job_id = imports.submit(info.name, paths, store=store, settings=settings)
        job = ImportExecutor(System(settings, store, storage), engine="spark").run(job_id)
        seconds = time.perf_counter() - started
    assert job.state is ImportState.COMPLETED, job.reason
    return seconds, job.imported_rows, peak


def measure(
    work: Path, store: MetaStore, storage: Storage, settings: Settings, rows: int, files: int
) -> dict[str, Any]:
    producer = Producer(System(settings, store, storage))
    info = producer.create_collection(f"bench{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    paths = make_files(work / f"input-{rows}", rows, files)
    input_bytes = sum(Path(p).stat().st_size for p in paths)
    with PeakRss() as base_peak:
        started = time.perf_counter()
        base_rows = baseline(paths, work / "baseline", len(info.vchannels))
        base_s = time.perf_counter() - started
    shutil.rmtree(work / "baseline")
    imp_s, imp_rows, imp_peak = run_import(store, storage, settings, info, paths)
    assert base_rows == imp_rows == rows, (base_rows, imp_rows, rows)
    shutil.rmtree(work / f"input-{rows}")
    result = {
        "rows": rows,
        "files": files,
        "input_bytes": input_bytes,
        "baseline_s": base_s,
        "import_s": imp_s,
        "baseline_rows_per_s": rows / base_s,
        "import_rows_per_s": rows / imp_s,
        "ratio_baseline_over_import": base_s / imp_s,
        "baseline_peak_rss_mb": base_peak.peak / 2**20,
        "import_peak_rss_mb": imp_peak.peak / 2**20,
        "import_peak_workers_rss_mb": imp_peak.peak_workers / 2**20,
    }
    print(
        f"{rows:,} rows in {files} files ({input_bytes / 1e9:.2f} GB): baseline {base_s:.1f}s, "
        f"import {imp_s:.1f}s, ratio {base_s / imp_s:.2f}; peak RSS import {imp_peak.peak / 2**20:.0f} MB "
        f"(Python workers {imp_peak.peak_workers / 2**20:.0f} MB), baseline {base_peak.peak / 2**20:.0f} MB",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--small", type=int, default=2_500_000, help="a second, smaller run (0: skip)")
    parser.add_argument("--out", default="bench/results/import.json")
    args = parser.parse_args()
    work, etcd, settings = bench_stack("vchan-bench-import-")
    report: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        store = MetaStore.connect(settings)
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        report["spark"] = get_spark(settings).version
        measure(work, store, storage, settings, 20_000, 2)  # JVM and Python workers warm
        report["large"] = measure(work, store, storage, settings, args.rows, args.files)
        if args.small:
            report["small"] = measure(work, store, storage, settings, args.small, args.files)
        store.close()
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
