"""Under sustained ingest, do the sort and the index builds keep up? Unindexed sorted segments over time.

    .venv/bin/python -m bench.index_keep_up [--minutes 5] [--rows 10000] [--period 5]
                                            [--type HNSW] [--param M=16 --param efConstruction=200]

On a scratch etcd and storage directory: a collection of clustered 128-d vectors in 2
vchannels with an index on its vector field (HNSW M=16, efConstruction=200 by default,
as in `bench.index_build`), and a real `vchan datacoord --engine local` process: its task
scheduler sorts each flushed segment (pushed by the flush's commit) and then builds its
index (pushed by the sort's commit), with mix compaction and GC as configured for the
lifecycle soak (every 10 s). Every `--period` seconds a round inserts `--rows` rows,
flushes and syncs both vchannels (a segment of `--rows`/2 rows per vchannel and round).

Sampled every 5 s: the backlog of the DataCoord — flushed segments not yet sorted, and
sorted segments of at least 1,024 rows without a Finished build of the index (their rows
are searched exactly until it lands). "Keeping up" means the backlog stays bounded: its
largest value in the second half of the run is no larger than in the first half plus one
round's segments, rather than growing with time. After the ingest stops, the time until
the backlog is empty. Also the share of the live rows served through an index in the
second half (a mix compaction's output starts unindexed: the share dips after each).

Results: bench/results/index_keep_up.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import bench_stack
from bench.index_build import clustered
from bench.lifecycle_soak import datacoord, sync_all
from vchan_assets.cli.indexes import key_values
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    MIN_ROWS_TO_BUILD,
    CollectionSchema,
    SegmentIndexState,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
)
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

SCHEMA = CollectionSchema.build("pk", {"vec": 128}, {"n": "int64"})
SAMPLE_EVERY = 5.0


def backlog(store: MetaStore, collection_id: int) -> dict[str, int]:
    """Unsorted flushed segments, and sorted ones (>= 1,024 rows) without a Finished build."""
    found, _ = store.list_models(store.keys.segment.under(collection_id), SegmentInfo)
    live = [
        d.model
        for d in found
        if d.model.state is SegmentState.FLUSHED and d.model.level is not SegmentLevel.L0
    ]
    finished = {
        b.model.segment_id
        for b in list_builds(store, collection_id)
        if b.model.state is SegmentIndexState.FINISHED
    }
    indexable = [s for s in live if s.is_sorted and s.num_rows >= MIN_ROWS_TO_BUILD]
    unindexed = [s for s in indexable if s.id not in finished]
    return {
        "unsorted": sum(not s.is_sorted for s in live),
        "unindexed": len(unindexed),
        "unindexed_rows": sum(s.num_rows for s in unindexed),
        "indexed_rows": sum(s.num_rows for s in indexable if s.id in finished),
        "live_rows": sum(s.num_rows for s in live),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the ingest runs")
    parser.add_argument("--rows", type=int, default=10_000, help="rows inserted per round")
    parser.add_argument("--period", type=float, default=5.0, help="seconds between round starts")
    parser.add_argument("--type", default="HNSW")
    parser.add_argument("--param", action="append", default=None, help="build parameter NAME=INT")
    parser.add_argument(
        "--drain", type=float, default=600.0, help="longest wait for the backlog to empty (s)"
    )
    parser.add_argument("--out", default="bench/results/index_keep_up.json")
    args = parser.parse_args()
    params = key_values(args.param or ["M=16", "efConstruction=200"], "--param")
    work, etcd, settings = bench_stack("vchan-keepup-")
    coord = None
    try:
        store = MetaStore.connect(settings)
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        producer = Producer(System(settings, store, storage))
        info = producer.create_collection("keepup", SCHEMA, num_channels=2)
        create_index(store, info, "vec", args.type, "L2", params)
        coord = datacoord(settings, Path(work) / "datacoord.log", defaults=False)
        samples: list[dict[str, Any]] = []
        started = time.monotonic()
        next_sample = 0.0
        rounds = 0
        seconds = args.minutes * 60
        print(
            f"ingest {args.rows:,} rows every {args.period:g}s ({args.rows / args.period:,.0f} rows/s) "
            f"for {args.minutes:g} min, index {args.type} {params}",
            flush=True,
        )
        while time.monotonic() - started < seconds:
            time.sleep(max(0.0, started + rounds * args.period - time.monotonic()))
            start_pk = rounds * args.rows
            pks = np.arange(start_pk, start_pk + args.rows, dtype=np.int64)
            producer.insert(
                info.name, {"pk": pks, "vec": clustered(args.rows, seed=rounds + 10), "n": pks % 7}
            )
            producer.flush(info.name)
            sync_all(store, storage, settings, info)
            rounds += 1
            now = time.monotonic() - started
            if now >= next_sample:
                samples.append({"t": round(now, 1), "rows": rounds * args.rows, **backlog(store, info.id)})
                print(f"  {samples[-1]}", flush=True)
                next_sample += SAMPLE_EVERY
        ingest_s = time.monotonic() - started
        drained_s = None
        while time.monotonic() - started < ingest_s + args.drain:
            now = backlog(store, info.id)
            if not now["unsorted"] and not now["unindexed"]:
                drained_s = round(time.monotonic() - started - ingest_s, 1)
                break
            time.sleep(1.0)
        half = [s for s in samples if s["t"] <= ingest_s / 2], [s for s in samples if s["t"] > ingest_s / 2]
        peak = [max((s["unindexed"] for s in part), default=0) for part in half]
        final = backlog(store, info.id)
        result = {
            "machine": f"{os.cpu_count()} cores (shared)",
            "index": f"{args.type} {params}",
            "rows_per_round": args.rows,
            "period_s": args.period,
            "ingest_rows_per_s": round(rounds * args.rows / ingest_s, 1),
            "rounds": rounds,
            "indexed_share_second_half": round(
                sum(s["indexed_rows"] for s in half[1]) / max(1, sum(s["live_rows"] for s in half[1])), 3
            ),
            "peak_unindexed_first_half": peak[0],
            "peak_unindexed_second_half": peak[1],
            "peak_unsorted": max((s["unsorted"] for s in samples), default=0),
            "bounded": peak[1] <= peak[0] + 2,
            "drained_after_s": drained_s,
            "final": final,
            "samples": samples,
        }
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2), flush=True)
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
        store.close()
    finally:
        if coord is not None:
            coord.terminate()
            try:
                coord.wait(60)
            except subprocess.TimeoutExpired:
                coord.kill()  # in the middle of a long build
                coord.wait()
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
