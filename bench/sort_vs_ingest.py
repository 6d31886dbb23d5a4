"""The claim behind the hand-off: the stats task (sort) is faster than ingest.

    .venv/bin/python -m bench.sort_vs_ingest [--rows 2000000] [--repeat 3] [--sync-engine spark]

Milvus 2.4's "Handoff growing segment after sorted" change leaves each flushed segment
invisible until the stats task has sorted it, on the ground that "the speed of stats is
greater than the insert speed". In one run, on one scratch etcd and storage directory, a
collection with a 128-d float vector and three scalars in 2 vchannels, each round:

- **ingest**: 2 producer processes (`bench.produce`'s, `Producer.insert` of 10,000-row
  batches) append N rows at full rate while a DataNode's channel workers (`ChannelWorker`,
  one thread per vchannel, the sync policies of the defaults, a 1 s poll, `--sync-engine`)
  persist them; when the producers are done, a flush; the clock runs from the first insert
  until `flush_state` is true (every row in binlogs, every segment Flushed).
- **sort**: `sort_step(engine="spark")`, the stats task, over the Flushed unsorted segments
  the ingest left: one Spark job on a warm local session (one task per segment), then the
  commit of each sorted copy. The clock runs around the call.

Reports rows/s of each and the ratio sort / ingest (the claim: >= 1.5), medians over the
rounds; also the producers' own rate (first to last insert, no sync), the time from the
last insert to persisted, and the fixed costs paid once per process, not per round
(SparkSession start; a first sort of a small collection, JVM warm-up). Before each timed
phase the disk is settled (`os.sync()`), and the 1-minute load average is recorded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench import bench_system, write_report
from bench.produce import BATCH, SCHEMA, run_producers
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.channel import ChannelWorker, NodeContext
from vchan_assets.lifecycle.plans import PlanState
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.spark import Engine
from vchan_assets.spark.session import get_spark
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

PRODUCERS = 2


def ingest(system: System, work: Path, rows: int, sync_engine: Engine, poll: float) -> dict[str, Any]:
    """2 producer processes and a DataNode's channel workers: `rows` inserted, flushed and
    persisted. Seconds from the first insert to `flush_state` true."""
    producer = Producer(system)
    info = producer.create_collection(f"ingest{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    ids = IdAllocator(system.store)
    ctx = NodeContext(system, node_id=1, engine=sync_engine, poll_interval=poll)
    workers = [
        ChannelWorker(ctx, info, v, grant_channel_lease(system.store, ids, v, node_id=1)).start()
        for v in info.vchannels
    ]
    try:
        run = run_producers(system.settings, work, info.name, PRODUCERS, rows)
        flush_ts = producer.flush(info.name)
        while not producer.flush_state(info.name, flush_ts):
            time.sleep(0.02)
        persisted = time.time()
    finally:
        for w in workers:
            w.stop()
    producer.close()
    seconds = persisted - run.started
    return {
        "collection": info.name,
        "rows": rows,
        "ingest_s": seconds,
        "ingest_rows_per_s": rows / seconds,
        "producers_rows_per_s": run.rows_per_s,
        "last_insert_to_persisted_s": persisted - run.ended,
    }


def unsorted_rows(store: MetaStore, collection_id: int) -> tuple[int, int]:
    """Rows and count of the collection's Flushed L1 segments not yet sorted."""
    found, _ = store.list_models(store.keys.segment.under(collection_id), SegmentInfo)
    waiting = [
        d.model
        for d in found
        if d.model.state is SegmentState.FLUSHED
        and d.model.level is SegmentLevel.L1
        and not d.model.is_sorted
    ]
    return sum(s.num_rows for s in waiting), len(waiting)


def sort(system: System, collection: str) -> dict[str, Any]:
    """The stats task over what the ingest flushed; checks every row came out sorted."""
    info = Producer(system).collection(collection)
    rows, segments = unsorted_rows(system.store, info.id)
    started = time.perf_counter()
    outcomes = sort_step(system, engine="spark")
    seconds = time.perf_counter() - started
    assert outcomes and all(o.state is PlanState.COMPLETED for o in outcomes), outcomes
    left, _ = unsorted_rows(system.store, info.id)
    found, _ = system.store.list_models(system.store.keys.segment.under(info.id), SegmentInfo)
    sorted_rows = sum(
        d.model.num_rows for d in found if d.model.state is SegmentState.FLUSHED and d.model.is_sorted
    )
    assert left == 0 and sorted_rows == rows, (left, sorted_rows, rows)
    return {"sorted_rows": rows, "segments": segments, "sort_s": seconds, "sort_rows_per_s": rows / seconds}


def round_trip(system: System, work: Path, rows: int, sync_engine: Engine, poll: float) -> dict[str, Any]:
    os.sync()
    load = os.getloadavg()[0]
    result = ingest(system, work, rows, sync_engine, poll)
    os.sync()
    result.update(sort(system, result["collection"]))
    assert result["sorted_rows"] == result["rows"], result
    result["ratio_sort_over_ingest"] = result["sort_rows_per_s"] / result["ingest_rows_per_s"]
    result["load_avg_1m"] = (round(load, 1), round(os.getloadavg()[0], 1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows ingested (and sorted) per round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians are reported)")
    parser.add_argument("--sync-engine", choices=("spark", "local"), default="spark")
    parser.add_argument("--poll", type=float, default=1.0, help="the channel workers' sync-policy poll (s)")
    parser.add_argument("--warmup-rows", type=int, default=40_000)
    parser.add_argument("--out", default="bench/results/sort_vs_ingest.json")
    args = parser.parse_args()
    for rows in (args.rows, args.warmup_rows):
        if rows % (PRODUCERS * BATCH):  # each producer inserts whole batches
            parser.error(f"rows must be a multiple of {PRODUCERS * BATCH:,}, not {rows:,}")
    report: dict[str, Any] = {"rows": args.rows, "sync_engine": args.sync_engine, "poll_s": args.poll}
    with bench_system("vchan-bench-sort-") as (work, system):
        started = time.perf_counter()
        spark = get_spark(system.settings)
        report["spark"] = spark.version
        report["spark_start_s"] = time.perf_counter() - started
        system = system.with_spark(spark)
        warm = round_trip(system, work, args.warmup_rows, args.sync_engine, args.poll)
        report["cold"] = {k: warm[k] for k in ("rows", "ingest_s", "sort_s")}
        print(f"cold (first round, {args.warmup_rows:,} rows, JVM warm-up): {report['cold']}", flush=True)
        rounds = []
        for r in range(args.repeat):
            result = round_trip(system, work, args.rows, args.sync_engine, args.poll)
            rounds.append(result)
            print(
                f"round {r + 1}: ingest {result['ingest_rows_per_s']:,.0f} rows/s ({result['ingest_s']:.2f}s; "
                f"producers alone {result['producers_rows_per_s']:,.0f} rows/s, last insert -> persisted "
                f"{result['last_insert_to_persisted_s']:.2f}s), sort {result['sort_rows_per_s']:,.0f} rows/s "
                f"({result['sort_s']:.2f}s, {result['segments']} segments): "
                f"{result['ratio_sort_over_ingest']:.2f}x; load {result['load_avg_1m']}",
                flush=True,
            )
    report["rounds"] = rounds
    keys = [k for k in rounds[0] if k != "collection" and isinstance(rounds[0][k], int | float)]
    report["median"] = m = {k: statistics.median(r[k] for r in rounds) for k in keys}
    print(
        f"median of {args.repeat}: ingest {m['ingest_rows_per_s']:,.0f} rows/s, sort "
        f"{m['sort_rows_per_s']:,.0f} rows/s, sort/ingest {m['ratio_sort_over_ingest']:.2f}x "
        f"(ratio of the medians {m['sort_rows_per_s'] / m['ingest_rows_per_s']:.2f}x)"
    )
    write_report(args.out, report)


if __name__ == "__main__":
    main()
