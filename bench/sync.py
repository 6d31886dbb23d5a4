"""Benchmark of the sync path: log -> binlogs with Spark, against plain pyarrow programs.

    .venv/bin/python -m bench.sync [--sizes 1000000,3000000] [--repeat 5] [--with-10m] [--schema varchar]

`--with-10m` adds a 10,000,000-row log (about 5 GB of log, 5 GB written per run: needs
about 12 GB free in the temporary directory and a few minutes).

For each size it generates a log of N rows (int64 pk, int64 ts, a 128-d float32
vector, three scalars; with `--schema varchar`, 36-character UUID pks and a JSON column
instead; with `--schema float16`, the vectors as float16) in one vchannel, then measures in
the same run, interleaved:
  - baseline (1 thread): plain pyarrow reads the log files one after the other and
    writes the same binlogs (column groups, split by segment, same writer settings, same
    atomic fsynced writes);
  - baseline (all cores): the same program over a thread pool of one thread per core,
    one log file per job: the strongest simple program for the job;
  - baseline (all cores, verified): the same, reading the log with its Parquet page
    checksums verified, as the sync does (a damaged log file must fail, not be persisted);
  - sync (spark): the real SyncTask on a warm local Spark session, commit included;
  - sync (local): the same task code in-process, without Spark (to show Spark's share);
  - the disk's own sequential write speed (a 1 GiB file written and fdatasync'ed): the
    physical limit of what any of them can write.
Each sync starts from a forgotten channel (meta and binlogs removed, same log); one
untimed Spark sync of each size's log comes before its rounds, so every task's Python
worker is started and warm (its seconds are reported as the first sync's). Every
timed run starts with the disk settled (`os.sync()`): the previous run's deletes and the
log just generated are written back first, so no run pays for another's writeback.
Reports seconds (median), rows/s, MB/s of log read and of binlogs written, the ratios
baseline/sync (>= 1 means the sync is faster) both as the ratio of the medians and as the
median of each round's own ratio (the programs of a round run within seconds of each
other, so a round's ratio is less exposed to the load of a shared machine drifting), the
load average over the runs and peak RSS of the process tree.
Also the fixed cost of a 1,000-row sync on a warm session, interleaved: through a Spark
job (`VCHAN_SYNC_IN_PROCESS_MB=0`), in the DataNode's process (the default,
`VCHAN_SYNC_IN_PROCESS_MB=32`: a range this small skips Spark), and an empty Spark job
alone (the floor of any sync that goes through Spark). The sizes above always run
through Spark (`VCHAN_SYNC_IN_PROCESS_MB=0`) or the local engine, as named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench import bench_stack
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.binlog_writer import column_groups, take_rows, write_parquet
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, DataType
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.format import MsgType
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalFile, WalReader

SCHEMA = CollectionSchema.build("pk", {"vec": 128}, {"n": "int64", "f": "float", "s": "string"})
# `--schema varchar`: 36-character ids (UUIDs) as the primary key and a JSON column, as
# document collections hold them.
VARCHAR_SCHEMA = CollectionSchema.build(
    "pk", {"vec": 128}, {"n": "int64", "f": "float", "meta": "json"}, pk_type="varchar(36)"
)
# `--schema float16`: the same rows with the vectors stored as float16 (half the bytes).
FLOAT16_SCHEMA = CollectionSchema.build(
    "pk", {"vec": "float16_vector(128)"}, {"n": "int64", "f": "float", "s": "string"}
)
SCHEMAS = {"int64": SCHEMA, "varchar": VARCHAR_SCHEMA, "float16": FLOAT16_SCHEMA}
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


def baseline_file(
    storage: Storage, schema: CollectionSchema, f: WalFile, out_prefix: str, verify: bool = False
) -> tuple[int, int]:
    """What a plain pyarrow program does with one log file: read it (with its page
    checksums verified if `verify`), keep the inserts, split them by segment, write each
    column group (fsynced). Returns (rows, bytes written)."""
    table = pq.read_table(storage.path(f.key), page_checksum_verification=verify)
    if f.data_key is not None:  # log format 2: the batch's columns, for its first rows
        data = pq.read_table(storage.path(f.data_key), page_checksum_verification=verify)
        table = table.slice(0, data.num_rows)
        for name in data.column_names:
            table = table.append_column(name, data[name])
    is_insert = pc.equal(table["msg_type"], MsgType.INSERT.value).to_numpy(zero_copy_only=False)
    segment_ids = table["segment_id"].fill_null(-1).to_numpy()
    rows = written = 0
    name = f.key.rsplit("/", 1)[-1]
    for seg in np.unique(segment_ids[is_insert]).tolist():
        part = take_rows(table, is_insert & (segment_ids == seg))
        for group, columns in column_groups(schema):
            out = f"{out_prefix}/{seg}/{group}/{name}"
            written += write_parquet(storage, out, part.select(columns), vector=group != 0)
        rows += part.num_rows
    return rows, written


def baseline(
    storage: Storage,
    info: CollectionInfo,
    vchannel: str,
    out_prefix: str,
    threads: int = 1,
    verify: bool = False,
) -> tuple[int, int]:
    """The simplest pyarrow program doing the same work, over `threads` threads (one log
    file per job); returns (rows, bytes written)."""
    files = WalReader(storage, vchannel, info).files()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        done = list(pool.map(lambda f: baseline_file(storage, info.schema, f, out_prefix, verify), files))
    return sum(r for r, _ in done), sum(w for _, w in done)


def disk_write_speed(directory: Path, size: int = 2**30, chunk: int = 8 * 2**20) -> float:
    """Sequential write speed of the disk under `directory`, in MB/s: `size` bytes written
    in `chunk`s then fdatasync'ed (as dd conv=fdatasync), the file removed after."""
    path = directory / f"disk-speed-{uuid.uuid4().hex}"
    data = np.random.default_rng(0).bytes(chunk)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(size // chunk):
            os.write(fd, data)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return size / 2**20 / seconds


def make_log(producer: Producer, rows: int, schema: CollectionSchema = SCHEMA) -> CollectionInfo:
    name = f"bench{uuid.uuid4().hex[:8]}"
    info = producer.create_collection(name, schema, num_channels=1)
    for start in range(0, rows, BATCH):
        batch = generate_rows(schema, min(BATCH, rows - start), start_pk=start, seed=start)
        if schema.primary.dtype is DataType.VARCHAR:  # UUIDs: 36 characters
            ids = pa.array([str(uuid.UUID(int=start + i)) for i in range(batch.num_rows)])
            batch = batch.set_column(0, schema.primary.name, ids)
        producer.insert(name, batch)
    return info


def reset_channel(store: MetaStore, storage: Storage, info: CollectionInfo) -> None:
    """Forget every sync of the collection: its segment meta, checkpoint and binlogs,
    so the next sync starts from the beginning of the same log."""
    store.delete_prefix(store.keys.segment.under(info.id))
    store.delete(store.keys.channel_checkpoint(info.vchannels[0]))
    for root in ("insert_log", "delta_log", "stats_log"):
        storage.filesystem.delete_dir_contents(storage.path(root), missing_dir_ok=True)


def timed_sync(
    store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo, engine: str
) -> dict[str, Any]:
    vchannel = info.vchannels[0]
    lease = grant_channel_lease(store, IdAllocator(store), vchannel, node_id=1)
    os.sync()  # settled disk: see the module's docstring
    with PeakRss() as rss:
        started = time.perf_counter()
        result = SyncTask(System(settings, store, storage), info, vchannel, lease, engine=engine).run()  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "rows": result.rows,
        "written_bytes": result.bytes,
        "peak_rss_mb": rss.peak / 2**20,
        "workers_rss_mb": rss.peak_workers / 2**20,
        "phases": asdict(result.phases) if result.phases else {},
    }


def timed_baseline(
    storage: Storage, info: CollectionInfo, out_prefix: str, threads: int, verify: bool = False
) -> dict[str, Any]:
    os.sync()  # settled disk: see the module's docstring
    started = time.perf_counter()
    with PeakRss() as rss:
        rows, written = baseline(storage, info, info.vchannels[0], out_prefix, threads, verify)
    seconds = time.perf_counter() - started
    storage.filesystem.delete_dir_contents(storage.path(out_prefix), missing_dir_ok=True)
    return {"seconds": seconds, "rows": rows, "written_bytes": written, "peak_rss_mb": rss.peak / 2**20}


RUNS = ("baseline_1", "baseline_all", "baseline_all_verified", "spark", "local")
BASELINES = RUNS[:3]


def measure_size(
    store: MetaStore,
    storage: Storage,
    settings: Settings,
    producer: Producer,
    size: int,
    repeat: int,
    schema: CollectionSchema = SCHEMA,
) -> dict[str, Any]:
    info = make_log(producer, size, schema)
    log_bytes = sum(f.size_bytes for f in WalReader(storage, info.vchannels[0], info).files())
    cores = os.cpu_count() or 1
    # One untimed sync of this log first: Spark stops a Python worker left idle for a
    # minute (writing a large log takes longer), and a 1,000-row sync starts only one, so
    # the first timed sync would otherwise start its tasks' workers and import the sync's
    # code in them. Its seconds are reported as `spark_first_s`.
    first = timed_sync(store, storage, settings, info, "spark")["seconds"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
    disk, loads = [], [os.getloadavg()[0]]
    for i in range(repeat):
        disk.append(disk_write_speed(Path(storage.base)))
        runs["baseline_1"].append(timed_baseline(storage, info, f"baseline/{size}/{i}", 1))
        runs["baseline_all"].append(timed_baseline(storage, info, f"baseline/{size}/{i}", cores))
        runs["baseline_all_verified"].append(
            timed_baseline(storage, info, f"baseline/{size}/{i}", cores, verify=True)
        )
        for engine in ("spark", "local"):
            reset_channel(store, storage, info)
            runs[engine].append(timed_sync(store, storage, settings, info, engine))
        loads.append(os.getloadavg()[0])
    reset_channel(store, storage, info)
    summary: dict[str, Any] = {
        "log_mb": log_bytes / 2**20,
        "disk_write_mb_per_s": statistics.median(disk),
        "load_avg_1m": (round(min(loads), 1), round(max(loads), 1)),
        "spark_first_s": first,
    }
    for name, measured in runs.items():
        assert all(m["rows"] == size for m in measured), f"{name} persisted a different row count"
        secs = statistics.median(m["seconds"] for m in measured)
        written = statistics.median(m["written_bytes"] for m in measured)
        summary[name] = {
            "median_s": secs,
            "runs_s": [round(m["seconds"], 3) for m in measured],
            "rows_per_s": size / secs,
            "read_mb_per_s": log_bytes / 2**20 / secs,
            "written_mb": written / 2**20,
            "written_mb_per_s": written / 2**20 / secs,
            "peak_rss_mb": max(m["peak_rss_mb"] for m in measured),
        }
        if name in ("spark", "local"):  # where a sync's seconds went, median of each phase
            summary[name]["phases_s"] = {
                phase: statistics.median(m["phases"][phase] for m in measured)
                for phase in measured[0]["phases"]
            }
    for name in ("spark", "local"):
        for base in BASELINES:
            summary[f"ratio_{name}_vs_{base}"] = summary[base]["median_s"] / summary[name]["median_s"]
            summary[f"round_ratio_{name}_vs_{base}"] = statistics.median(
                b["seconds"] / m["seconds"] for b, m in zip(runs[base], runs[name], strict=True)
            )
        summary[f"{name}_written_vs_disk"] = (
            summary[name]["written_mb_per_s"] / summary["disk_write_mb_per_s"]
        )
    store.delete_prefix(store.keys.segment.under(info.id))
    for root in ("wal", "wal-data"):  # the log files and (log format 2) their data files
        storage.filesystem.delete_dir_contents(
            storage.path(f"{root}/{info.vchannels[0]}"), missing_dir_ok=True
        )
    return summary


def print_size(size: int, summary: dict[str, Any]) -> None:
    print(
        f"\n{size:,} rows, log {summary['log_mb']:.0f} MB, disk writes {summary['disk_write_mb_per_s']:.0f} MB/s, "
        f"load average {summary['load_avg_1m'][0]}-{summary['load_avg_1m'][1]}; "
        f"untimed first sync (Spark) {summary['spark_first_s']:.2f}s"
    )
    for name in RUNS:
        s = summary[name]
        print(
            f"  {name:22s} {s['median_s']:6.2f}s  {s['rows_per_s'] / 1e6:5.2f}M rows/s  "
            f"read {s['read_mb_per_s']:5.0f} MB/s  written {s['written_mb_per_s']:5.0f} MB/s  "
            f"peak RSS {s['peak_rss_mb']:5.0f} MB  runs {s['runs_s']}"
        )
    print(
        f"  ratio sync(spark) vs baseline: 1 thread {summary['ratio_spark_vs_baseline_1']:.2f}, "
        f"all cores {summary['ratio_spark_vs_baseline_all']:.2f}, "
        f"all cores verified {summary['ratio_spark_vs_baseline_all_verified']:.2f} "
        f"(median of the rounds' own ratios: {summary['round_ratio_spark_vs_baseline_1']:.2f}, "
        f"{summary['round_ratio_spark_vs_baseline_all']:.2f}, "
        f"{summary['round_ratio_spark_vs_baseline_all_verified']:.2f}); "
        f"sync written / disk speed {summary['spark_written_vs_disk']:.2f}",
    )
    for name in ("spark", "local"):
        phases = ", ".join(f"{phase} {s:.2f}s" for phase, s in summary[name]["phases_s"].items())
        print(f"  sync ({name}) phases, medians: {phases}", flush=True)


def empty_spark_job(spark: Any) -> float:
    """Seconds of a Spark job with one task that does nothing (scheduling, one Python worker
    round trip): what a sync through Spark pays however few rows it writes."""
    started = time.perf_counter()
    spark.sparkContext.parallelize([0], 1).mapPartitions(lambda rows: rows).collect()
    return time.perf_counter() - started


def fixed_cost(
    store: MetaStore,
    storage: Storage,
    settings: Settings,
    producer: Producer,
    spark: Any,
    rounds: int = 7,
    schema: CollectionSchema = SCHEMA,
) -> dict[str, float]:
    """Median seconds of a 1,000-row sync on a warm session through a Spark job and in
    process, and of an empty Spark job; interleaved."""
    through_spark = replace(settings, sync_in_process_mb=0.0)
    in_process = replace(settings, sync_in_process_mb=32.0)
    runs: dict[str, list[float]] = {"spark_job": [], "in_process": [], "empty_spark_job": []}
    for _ in range(rounds):
        for name, run_settings in (("spark_job", through_spark), ("in_process", in_process)):
            small = make_log(producer, 1000, schema)
            runs[name].append(timed_sync(store, storage, run_settings, small, "spark")["seconds"])
        runs["empty_spark_job"].append(empty_spark_job(spark))
    medians = {name: statistics.median(seconds) for name, seconds in runs.items()}
    for name, seconds in runs.items():
        print(
            f"1,000-row sync, warm Spark, {name}: median {medians[name]:.3f}s of {[round(x, 3) for x in seconds]}"
        )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000000,3000000")
    parser.add_argument("--with-10m", action="store_true", help="add 10,000,000 rows to --sizes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="bench/results/sync.json")
    parser.add_argument(
        "--schema",
        choices=sorted(SCHEMAS),
        default="int64",
        help="int64: an int64 pk and three scalars; varchar: 36-character ids (UUIDs) and a JSON column; "
        "float16: the int64 schema with float16 vectors",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.with_10m:
        sizes.append(10_000_000)

    work, etcd, settings = bench_stack()
    settings = replace(settings, sync_in_process_mb=0.0)  # "spark" runs are Spark jobs, however small
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    producer = Producer(System(settings, store, storage))
    report: dict[str, Any] = {
        "sizes": {},
        "spark_partitions": settings.spark_partitions,
        "cores": os.cpu_count(),
    }
    try:
        spark = get_spark(settings)
        report["spark"] = spark.version
        schema = SCHEMAS[args.schema]
        report["schema"] = args.schema
        warm = make_log(producer, 1000, schema)
        timed_sync(store, storage, settings, warm, "spark")  # JVM and Python workers warm

        report["sync_1000_rows_warm_s"] = fixed_cost(store, storage, settings, producer, spark, schema=schema)
        for size in sizes:
            report["sizes"][size] = summary = measure_size(
                store, storage, settings, producer, size, args.repeat, schema
            )
            print_size(size, summary)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"\nwritten {args.out}")
    finally:
        store.close()
        etcd.stop()


if __name__ == "__main__":
    main()
