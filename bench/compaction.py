"""Benchmarks of the segment lifecycle.

    .venv/bin/python -m bench.compaction [--rows 3000000] [--repeat 3] [--soak 120]

1. Compaction throughput. N rows (int64 pk, a 32-d float32 vector, three scalars) in
   two vchannels, flushed as 6 segments per vchannel, 1% of the pks deleted. Measured in
   the same run on the same input segments:
     - baseline: a plain pyarrow program using all cores (one thread per vchannel group;
       pyarrow's own thread pool inside) reads the input binlogs, drops the deleted rows,
       sorts by pk and writes the column groups, with the same writer settings;
     - mix compaction (spark): the real trigger, executor (one Spark task per plan, i.e.
       per vchannel) and commit, on a warm local Spark session.
   Reports seconds (median), rows/s and the ratio baseline/compaction (>= 1: faster).
2. Soak: small syncs (2,000 rows, 1% deletes, flush, sync) for `--soak` seconds, once
   without and once with the lifecycle step after every sync (tolerances and log
   retention shortened to seconds); segments, binlog files and bytes, log files and
   bytes at the end, and how they grew.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pyarrow as pa

from bench import bench_stack, write_report
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.binlog_writer import column_groups, write_parquet
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.lifecycle.checks import storage_figures
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.lifecycle.step import lifecycle_step
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentInfo, SegmentLevel
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import apply_deletes_to, read_files, segment_rows
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 32}, {"n": "int64", "f": "float", "s": "string"})
SEGMENTS_PER_CHANNEL = 6


def sync_all(store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo) -> None:
    for vchannel in info.vchannels:
        lease = store.read_lease(vchannel) or grant_channel_lease(store, IdAllocator(store), vchannel, 1)
        SyncTask(System(settings, store, storage), info, vchannel, lease, engine="local").run()


def make_segments(
    producer: Producer, store: MetaStore, storage: Storage, settings: Settings, rows: int
) -> CollectionInfo:
    info = producer.create_collection(f"bench{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=2)
    per = rows // SEGMENTS_PER_CHANNEL
    for i in range(SEGMENTS_PER_CHANNEL):
        for start in range(i * per, (i + 1) * per, 100_000):
            n = min(100_000, (i + 1) * per - start)
            producer.insert(info.name, generate_rows(SCHEMA, n, start_pk=start, seed=start))
        producer.delete(info.name, list(range(i * per, (i + 1) * per, 100)), partition="_default")
        producer.flush(info.name)
        sync_all(store, storage, settings, info)
    return info


def baseline(storage: Storage, info: CollectionInfo, segments: list[SegmentInfo], out: str) -> int:
    """The plain program: per vchannel group, read, drop deleted rows, sort, write groups."""
    deletes = read_files(storage, [b.path for s in segments for b in s.deltalogs], ["pk", "timestamp"])
    assert deletes is not None
    groups = column_groups(info.schema)

    def merge(vchannel: str) -> int:
        inputs = [s for s in segments if s.vchannel == vchannel and s.level is SegmentLevel.L1]
        rows = pa.concat_tables([segment_rows(storage, s) for s in inputs])
        rows = apply_deletes_to(rows, deletes, "pk").sort_by(
            [("pk", "ascending"), ("timestamp", "ascending")]
        )
        for group, columns in groups:
            key = f"{out}/{vchannel}/{group}.parquet"
            write_parquet(storage, key, rows.select(["row_id", *columns[1:]]), group != 0)
        return int(rows.num_rows)

    with ThreadPoolExecutor(len(info.vchannels)) as pool:
        return sum(pool.map(merge, info.vchannels))


def snapshot(store: MetaStore, info: CollectionInfo) -> dict[str, bytes]:
    return {kv.key: kv.value for kv in store.list_prefix(store.keys.segment.under(info.id)).items}


def restore(store: MetaStore, saved: dict[str, bytes], info: CollectionInfo) -> None:
    store.delete_prefix(store.keys.segment.under(info.id))
    store.delete_prefix(store.keys.compaction_plan.prefix)
    for key, value in saved.items():
        store.put(key, value)


def throughput(
    store: MetaStore, storage: Storage, settings: Settings, rows: int, repeat: int
) -> dict[str, Any]:
    producer = Producer(System(settings, store, storage))
    info = make_segments(producer, store, storage, settings, rows)
    saved = snapshot(store, info)
    segments = [d.model for d in store.list_models(store.keys.segment.under(info.id), SegmentInfo)[0]]
    runs: dict[str, list[float]] = {"baseline": [], "compaction": []}
    for i in range(repeat):
        started = time.perf_counter()
        kept = baseline(storage, info, segments, f"baseline/{i}")
        runs["baseline"].append(time.perf_counter() - started)
        restore(store, saved, info)
        started = time.perf_counter()
        CompactionTrigger(System(settings, store, storage)).trigger(info, CompactionType.MIX, manual=True)
        outcomes = CompactionExecutor(System(settings, store, storage), engine="spark").run_pending()
        runs["compaction"].append(time.perf_counter() - started)
        assert all(o.state is PlanState.COMPLETED for o in outcomes), outcomes
        live = [d.model for d in store.list_models(store.keys.segment.under(info.id), SegmentInfo)[0]]
        out_rows = sum(s.num_rows for s in live if s.compaction_from and s.state.value == "Flushed")
        assert out_rows == kept, (out_rows, kept)
    base, comp = statistics.median(runs["baseline"]), statistics.median(runs["compaction"])
    result = {
        "rows": rows,
        "rows_after_deletes": kept,
        "baseline_s": base,
        "compaction_s": comp,
        "runs": runs,
        "baseline_rows_per_s": rows / base,
        "compaction_rows_per_s": rows / comp,
        "ratio_baseline_over_compaction": base / comp,
    }
    print(
        f"{rows:,} rows: baseline {base:.2f}s, mix compaction (spark) {comp:.2f}s, "
        f"ratio {base / comp:.2f} (runs {runs})",
        flush=True,
    )
    return result


def soak(settings: Settings, seconds: float, lifecycle: bool) -> dict[str, Any]:
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    producer = Producer(System(settings, store, storage))
    info = producer.create_collection(f"soak{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
    quick = replace(
        settings, gc_interval=1.0, gc_missing_tolerance=2.0, gc_drop_tolerance=2.0, wal_retention=2.0
    )
    samples = []
    started = time.monotonic()
    rounds = 0
    while time.monotonic() - started < seconds:
        producer.insert(info.name, generate_rows(SCHEMA, 2000, start_pk=rounds * 2000, seed=rounds))
        producer.delete(info.name, list(range(rounds * 2000, rounds * 2000 + 20)), partition="_default")
        producer.flush(info.name)
        sync_all(store, storage, settings, info)
        if lifecycle:
            lifecycle_step(System(quick, store, storage), engine="local")
        rounds += 1
        if rounds % 10 == 0:
            samples.append({"t": round(time.monotonic() - started, 1), **storage_figures(store, storage)})
    final = {"rounds": rounds, **storage_figures(store, storage)}
    store.close()
    print(f"soak {seconds:.0f}s, lifecycle={lifecycle}: {final}", flush=True)
    return {"final": final, "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=3_000_000, help="0: skip the throughput part")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--soak", type=float, default=120.0, help="seconds of each soak run (0: skip)")
    parser.add_argument("--out", default="bench/results/compaction.json")
    args = parser.parse_args()
    work, etcd, settings = bench_stack()
    report: dict[str, Any] = {}
    try:
        store = MetaStore.connect(settings)
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        if args.rows:
            report["spark"] = get_spark(settings).version
        if args.rows:
            throughput(store, storage, settings, 20_000, 1)  # JVM and Python workers warm
            report["throughput"] = throughput(store, storage, settings, args.rows, args.repeat)
        store.close()
        if args.soak:
            for lifecycle in (False, True):
                root = f"soak{int(lifecycle)}"
                soaked = replace(settings, root=root, storage_uri=str(work / root))
                report[f"soak_lifecycle_{lifecycle}"] = soak(soaked, args.soak, lifecycle)
    finally:
        etcd.stop()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
