"""The DataCoord's step at 100,000 segments: segment meta held in memory (`SegmentCache`,
what `vchan datacoord` runs with) against listing etcd for every pass (what it did before).

    .venv/bin/python -m bench.datacoord_meta [--sizes 1000 100000] [--etcd-up-to 20000]

One collection of 4 vchannels on a real etcd, N synthetic flushed, sorted segments
(realistic values, ~1.9 KB each, written straight to etcd with their index entries). For
each N:

- the cache's load: seconds, and the process's resident memory before and after
  (`VmRSS`), and etcd bytes per segment (the values and their index entries);
- the DataCoord's step, three times: another client creates 5 segments (so the meta
  reload has a change to read), then one coordinator tick (channel reconcile, seal
  policies, the reload with its repair of the per-vchannel index and seal of orphans),
  the task scheduler's scan (sort and index discovery) and a lifecycle step (plans,
  compaction planning over every segment, which finds none small enough to run, and
  garbage collection); seconds, and keys and bytes read from etcd;
- the same step with the cache taken away, for N up to `--etcd-up-to` (at 100,000
  segments each pass would read ~200 MB);
- `vchan status` as the CLI runs it (its own store, no cache), after the steps wrote the
  segment summaries: the default report (from the summaries; median of 3) against
  `--segments` (every segment listed in pages: the whole-table report the default was
  before, which read the segments once more for the vchannel rows), seconds and keys and
  bytes read from etcd, and their ratio.

The targets: the step with the cache under 1 s at 100,000 segments, and its ratio to the
same at 1,000; the default `vchan status` well under 1 s at 100,000 segments. Results: bench/results/datacoord_meta.json (or `--out`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import bench_system, write_report
from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.datacoord.tasks import TaskScheduler
from vchan_assets.indexes.tasks import IndexTasks
from vchan_assets.lifecycle.sort_tasks import SortTasks
from vchan_assets.lifecycle.step import lifecycle_step
from vchan_assets.meta.segment_cache import SegmentCache
from vchan_assets.meta.store import MetaStore
from vchan_assets.status import SegmentDetail, collect_status
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA
from vchan_assets.testing.steps import write_segments
from vchan_assets.wal.producer import Producer

STEPS = 3


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def step(
    system: System,
    coordinator: DataCoordinator,
    tasks: TaskScheduler,
    writer: MetaStore,
    n: int,
    i: int,
    info: Any,
) -> dict[str, Any]:
    """One DataCoord step after another client created 5 segments."""
    write_segments(
        writer, info, info.vchannels[i % len(info.vchannels)], 5, first=50_000_000 + n * 10 + i * 5
    )
    stores = [system.store, coordinator.writer]  # the writer (fenced by the term) counts its own reads

    def reads() -> tuple[int, int]:
        return sum(s.keys_read for s in stores if s), sum(s.bytes_read for s in stores if s)

    (keys, read), started, cpu = reads(), time.perf_counter(), time.process_time()
    tick = coordinator.tick()
    tasks.scan(system)
    lifecycle_step(system, engine="local", compact=True, sort=True)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert tick.reloaded, "the reload saw no change"
    after = reads()
    return {"seconds": seconds, "cpu": cpu, "keys": after[0] - keys, "bytes": after[1] - read}


def status_timing(catalog: Catalog, detail: SegmentDetail | None) -> dict[str, Any]:
    """One `collect_status` (the CLI's, no orphans): seconds, keys and bytes read from etcd."""
    store = catalog.store
    keys, read, started = store.keys_read, store.bytes_read, time.perf_counter()
    collect_status(catalog, segments=detail)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "keys": store.keys_read - keys, "bytes": store.bytes_read - read}


def status_row(system: System, n: int) -> dict[str, Any]:
    """The default `vchan status` (summaries) against `--segments` (every segment), as the
    CLI runs them: a store of its own, without the DataCoord's cache."""
    store = MetaStore.connect(system.settings)
    try:
        catalog = Catalog(replace(system, store=store))
        default = [status_timing(catalog, None) for _ in range(STEPS)]
        whole = status_timing(catalog, SegmentDetail())
    finally:
        store.close()
    median = statistics.median(s["seconds"] for s in default)
    row = {
        "segments": n,
        "path": "status",
        "status_s_median": round(median, 3),
        "status_keys": default[-1]["keys"],
        "status_bytes": default[-1]["bytes"],
        "segments_flag_s": round(whole["seconds"], 3),
        "segments_flag_keys": whole["keys"],
        "segments_flag_bytes": whole["bytes"],
        "seconds_ratio": round(whole["seconds"] / median, 1),
        "bytes_ratio": round(whole["bytes"] / max(1, default[-1]["bytes"]), 1),
        "load_1m": round(os.getloadavg()[0], 1),
    }
    print(f"    {row}", flush=True)
    return row


def one_size(system: System, writer: MetaStore, n: int, with_etcd: bool) -> list[dict[str, Any]]:
    info = Producer(system).create_collection(f"c{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=4)
    started = time.perf_counter()
    meta_bytes = sum(
        write_segments(writer, info, v, n // 4, first=10_000_000 + j * n)
        for j, v in enumerate(info.vchannels)
    )
    print(
        f"  N={n:,}: {meta_bytes / 2**20:.1f} MiB of segment meta in {time.perf_counter() - started:.0f}s",
        flush=True,
    )
    rows = []
    for path in ("cache", "etcd") if with_etcd else ("cache",):
        store = MetaStore.connect(system.settings)
        before = rss_mb()
        load = 0.0
        cache = None
        if path == "cache":
            started = time.perf_counter()
            cache = SegmentCache(store).start()
            assert cache.wait_loaded(600), "the cache did not load"
            store.segment_cache = cache
            load = time.perf_counter() - started
            # the first read decodes every value once (later reads reuse the decoded records)
        local = replace(system, store=store)
        coordinator = DataCoordinator(system.settings, store, reload_interval=0.0)
        assert coordinator.election.campaign(timeout=30)
        try:
            coordinator.tick()
            tasks = TaskScheduler([SortTasks(), IndexTasks()], system.settings)
            steps = [step(local, coordinator, tasks, writer, n, i, info) for i in range(STEPS)]
        finally:
            coordinator.election.resign()
            if cache is not None:
                cache.stop()
            store.close()
        row = {
            "segments": n,
            "segment_meta_mib": round(meta_bytes / 2**20, 1),
            "etcd_bytes_per_segment": round(meta_bytes / n),
            "path": path,
            "load_s": round(load, 2),
            "rss_mb_added": round(rss_mb() - before, 1),
            "step_s_median": round(statistics.median(s["seconds"] for s in steps), 3),
            "step_s_max": round(max(s["seconds"] for s in steps), 3),
            # the bench process's CPU seconds in the step (what a loaded machine changes least)
            "step_cpu_s_median": round(statistics.median(s["cpu"] for s in steps), 3),
            "step_keys": steps[-1]["keys"],
            "step_bytes": steps[-1]["bytes"],
            "load_1m": round(os.getloadavg()[0], 1),
        }
        print(f"    {row}", flush=True)
        rows.append(row)
    rows.append(status_row(system, n))  # the steps' reloads wrote the summaries
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument(
        "--etcd-up-to", type=int, default=20_000, help="the largest N stepped without the cache too"
    )
    parser.add_argument("--out", default="bench/results/datacoord_meta.json")
    args = parser.parse_args()
    with bench_system("vchan-datacoord-meta-") as (_, opened):
        # Segments of 4,000 rows are not small (under a millionth of a segment): compaction plans over
        # every segment and finds nothing to run (their files are not written).
        system = replace(opened, settings=replace(opened.settings, compaction_small_proportion=1e-6))
        rows = [
            r for n in args.sizes for r in one_size(system, system.store, n, with_etcd=n <= args.etcd_up_to)
        ]
    cached = {r["segments"]: r["step_s_median"] for r in rows if r["path"] == "cache"}
    smallest, largest = min(cached), max(cached)
    ratio = round(cached[largest] / cached[smallest], 2)
    print(f"DataCoord step with the cache at {largest:,} / at {smallest:,} segments: {ratio}")
    write_report(args.out, {"rows": rows, "step_ratio_largest_over_smallest": ratio})


if __name__ == "__main__":
    main()
