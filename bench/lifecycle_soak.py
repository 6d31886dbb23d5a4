"""Soak: small syncs with 1% deletes for N minutes, with and without the segment lifecycle.

    .venv/bin/python -m bench.lifecycle_soak [--minutes 10] [--rows 2000] [--period 1.0] [--defaults]

Two runs at the same time, each in its own process on its own etcd root and storage
directory, so both see the same machine load:

- **without**: rounds only (insert `--rows` rows over 2 vchannels, delete 1% of the live
  pks chosen at random among all earlier rounds, flush, sync both channels);
- **with**: the same rounds, and beside them a real `vchan datacoord --engine local`
  process running the lifecycle: each flushed segment pushed to the sort by an etcd watch
  as its flush commits, the full step (L0 and size-tiered mix compaction) and garbage
  collection every 10 s, dropped segments collected 30 s after their drop (and the
  time-travel window shortened to match), log files 30 s after the checkpoint passed them.

With `--defaults` only the second run, its DataCoord on the default settings (what a
user gets: the compaction check every 10 s triggers L0 compaction past 10 L0 segments of a
partition and merges small segments; the full step every 300 s; GC hourly): whether the
lifecycle keeps up with ingest by itself. `--period 0` starts rounds back to back (full rate).

One round starts every `--period` seconds (at once if the previous one took longer), so
both runs write the same data. Every 30 s and at the end: live segments, binlog files
and bytes, rows stored vs live rows, log files and bytes; for the lifecycle run also
the time from a segment's flush to its replacement by a sorted segment (a 0.2 s poller).
At the end both runs are checked: the rows read back (deletes applied) equal the live
pks, and the sync and lifecycle checks pass.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench import bench_stack
from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.checks import check_log_rows
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.lifecycle.checks import check_live_files_exist, check_unique_live_pks, storage_figures
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 32}, {"n": "int64", "f": "float", "s": "string"})
SAMPLE_EVERY = 30.0
LIFECYCLE_ENV = {
    "VCHAN_LIFECYCLE_INTERVAL": "10",
    "VCHAN_GC_INTERVAL": "10",
    "VCHAN_GC_DROP_TOLERANCE": "30",
    "VCHAN_TIME_TRAVEL": "30",
    "VCHAN_GC_MISSING_TOLERANCE": "60",
    "VCHAN_WAL_RETENTION": "30",
}


def _segments(store: MetaStore) -> list[SegmentInfo]:
    found, _ = store.list_models(store.keys.segment.prefix, SegmentInfo)
    return [d.model for d in found]


def figures(store: MetaStore, storage: Storage, live_rows: int) -> dict[str, Any]:
    """What storage holds, and of it what live segment meta names (the rest is reclaimable)."""
    live = [s for s in _segments(store) if s.state is not SegmentState.DROPPED]
    l1 = [s for s in live if s.level is not SegmentLevel.L0]
    return {
        **storage_figures(store, storage),
        "l0_segments": len(live) - len(l1),
        "invisible_segments": sum(s.is_invisible for s in l1),
        "live_files": sum(len(s.binlog_files) + len(s.deltalogs) + len(s.statslogs) for s in live),
        "live_binlog_bytes": sum(
            b.size_bytes for s in live for b in (*s.binlog_files, *s.deltalogs, *s.statslogs)
        ),
        "rows_stored": sum(s.num_rows for s in l1),
        "live_rows": live_rows,
    }


class SortLatency(threading.Thread):
    """Polls segment meta: when a Flushed L1 segment first appears unsorted, and when it is
    Dropped (replaced by a sorted or merged one): the flush-to-sorted time. Also, from the
    meta itself (no poller in it), its flush time to its replacement's commit
    (`flushed_at` -> `dropped_at`)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(daemon=True)
        self.store = MetaStore.connect(settings)
        self.seen: dict[int, float] = {}
        self.seconds: list[float] = []
        self.exact: dict[int, float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.2):
            now = time.monotonic()
            for s in _segments(self.store):
                if s.level is SegmentLevel.L0 or s.compaction_from:
                    continue
                if s.state is SegmentState.FLUSHED and s.id not in self.seen:
                    self.seen[s.id] = now
                elif s.state is SegmentState.DROPPED and s.id in self.seen:
                    self.seconds.append(now - self.seen.pop(s.id))
                if s.state is SegmentState.DROPPED and s.flushed_at and s.dropped_at:
                    self.exact[s.id] = s.dropped_at - s.flushed_at

    def summary(self) -> dict[str, float | int]:
        self.halt.set()
        self.join(5)
        self.store.close()
        xs = sorted(self.seconds)
        if not xs:
            return {"sorted": 0}
        exact = sorted(self.exact.values())
        return {
            "sorted": len(xs),
            "median_s": round(statistics.median(xs), 2),
            "p95_s": round(xs[int(0.95 * (len(xs) - 1))], 2),
            "max_s": round(xs[-1], 2),
            "unsorted_at_end": len(self.seen),
            **(
                {
                    "meta_median_s": round(statistics.median(exact), 2),
                    "meta_p95_s": round(exact[int(0.95 * (len(exact) - 1))], 2),
                }
                if exact
                else {}
            ),
        }


def sync_all(store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo) -> None:
    for vchannel in info.vchannels:
        lease = store.read_lease(vchannel) or grant_channel_lease(store, IdAllocator(store), vchannel, 1)
        SyncTask(System(settings, store, storage), info, vchannel, lease, engine="local").run()


def datacoord(settings: Settings, log: Path, defaults: bool) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(settings.to_env())
    if not defaults:
        env.update(LIFECYCLE_ENV)
    vchan = Path(sys.executable).with_name("vchan")
    with open(log, "wb") as out:
        return subprocess.Popen(
            [str(vchan), "datacoord", "--engine", "local"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def check(
    store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo, live: set[int]
) -> bool:
    rows = Catalog(System(settings, store, storage)).read_collection(
        info.name, as_arrow=True, with_vectors=False
    )
    assert isinstance(rows, pa.Table)
    pks = rows["pk"].to_pylist()
    ok = len(pks) == len(set(pks)) and set(pks) == live
    ok = ok and all(check_log_rows(store, storage, info, v).passed for v in info.vchannels)
    return (
        ok and check_unique_live_pks(store, storage).passed and check_live_files_exist(store, storage).passed
    )


def soak(
    settings: Settings, seconds: float, rows: int, period: float, lifecycle: bool, defaults: bool = False
) -> dict[str, Any]:
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    producer = Producer(System(settings, store, storage))
    info = producer.create_collection("soak", SCHEMA, num_channels=2)
    log = Path(settings.home) / f"datacoord-{settings.root}.log"
    coord = datacoord(settings, log, defaults) if lifecycle else None
    latency = SortLatency(settings) if lifecycle else None
    if latency:
        latency.start()
    rng = np.random.default_rng(7)
    live: set[int] = set()
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    next_sample = SAMPLE_EVERY
    rounds = 0
    try:
        while time.monotonic() - started < seconds:
            due = started + rounds * period
            time.sleep(max(0.0, due - time.monotonic()))
            batch = generate_rows(SCHEMA, rows, start_pk=rounds * rows, seed=rounds)
            producer.insert(info.name, batch)
            live.update(batch["pk"].to_pylist())
            doomed = rng.choice(np.fromiter(live, np.int64), size=rows // 100, replace=False).tolist()
            producer.delete(info.name, doomed, partition="_default")
            live.difference_update(doomed)
            producer.flush(info.name)
            sync_all(store, storage, settings, info)
            rounds += 1
            if time.monotonic() - started >= next_sample:
                samples.append({"t": round(time.monotonic() - started), **figures(store, storage, len(live))})
                print(f"  {'with' if lifecycle else 'without'} lifecycle: {samples[-1]}", flush=True)
                next_sample += SAMPLE_EVERY
    finally:
        if coord is not None:
            coord.terminate()
            coord.wait(60)
    final = {"rounds": rounds, **figures(store, storage, len(live))}
    result: dict[str, Any] = {
        "final": final,
        "samples": samples,
        "checks_passed": check(store, storage, settings, info, live),
    }
    if latency:
        result["flush_to_sorted"] = latency.summary()
    store.close()
    return result


def _child(
    settings: Settings, seconds: float, rows: int, period: float, lifecycle: bool, defaults: bool, out: Path
) -> None:
    out.write_text(json.dumps(soak(settings, seconds, rows, period, lifecycle, defaults)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--rows", type=int, default=2000, help="rows inserted per round (1%% of that deleted)"
    )
    parser.add_argument("--period", type=float, default=1.0, help="seconds between round starts")
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="only the run with the lifecycle, its DataCoord on the default settings (compaction "
        "check every 10 s, full step every 300 s, GC hourly, dropped files kept 3 h)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out_path = args.out or f"bench/results/lifecycle_soak{'_defaults' if args.defaults else ''}.json"
    work, etcd, settings = bench_stack("vchan-soak-")
    report: dict[str, Any] = {
        "minutes": args.minutes,
        "rows_per_round": args.rows,
        "period_s": args.period,
        "datacoord_settings": "defaults" if args.defaults else LIFECYCLE_ENV,
    }
    runs_of = (True,) if args.defaults else (False, True)
    try:
        spawn = multiprocessing.get_context("spawn")
        runs = {}
        for lifecycle in runs_of:
            root = f"soak{int(lifecycle)}"
            each = replace(settings, root=root, storage_uri=str(work / root))
            out = work / f"{root}.json"
            proc = spawn.Process(
                target=_child,
                args=(each, args.minutes * 60, args.rows, args.period, lifecycle, args.defaults, out),
            )
            proc.start()
            runs[lifecycle] = (proc, out)
        for lifecycle, (proc, out) in runs.items():
            proc.join()
            report[f"lifecycle_{lifecycle}"] = (
                json.loads(out.read_text()) if out.exists() else {"failed": proc.exitcode}
            )
    finally:
        etcd.stop()
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    for lifecycle in runs_of:
        run = report[f"lifecycle_{lifecycle}"]
        print(
            f"{'with' if lifecycle else 'without'} lifecycle: {run.get('final')} checks={run.get('checks_passed')}"
        )
        if "flush_to_sorted" in run:
            print(f"  flush -> sorted: {run['flush_to_sorted']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
