"""A change stream against the batch reader, and the stream's end-to-end latency.

    .venv/bin/python -m bench.stream [--rows 10000000] [--segments 20] [--latency-seconds 30]

**Throughput.** N rows (int64 pk, an 8-d vector, three scalars) over 2 vchannels, inserted
in batches of 100k, flushed and synced in `--segments` rounds with 0.1% of each round's pks
deleted (`bench.pushdown.build`): the log holds N inserts and N/1000 deletes, the binlogs
the same data. On one warm local Spark session (a count of the collection first), in the
same run:

- batch: `spark.read.format("vchan")` of the collection (every field) written to Parquet;
- stream: `spark.readStream.format("vchan")` of the same collection (every field, the
  default `upTo=checkpoint`: all of it is synced) written to a Parquet sink with
  `trigger(availableNow=True)`, from `startingOffsets=earliest` to the end.

Reports rows/s of each (rows written to Parquet / seconds) and stream / batch (target
>= 0.8x).

**Latency.** A second collection, a streaming query with `upTo=head` and
`trigger(processingTime=--trigger-ms)` into a Parquet sink, while a producer inserts
`--batch-rows` rows every `--interval` seconds for `--latency-seconds`. A poller reads the
sink's metadata log (what Spark has committed) every 20 ms and the new files' pks; an
insert's latency is from its acknowledgement to the poll that finds all of its rows in
the sink. Reports p50 and p95.

Results go to `--out` (bench/results/stream.json); BENCHMARKS.md "Change streams" has the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.errors import StreamingQueryException

from bench import bench_parser, bench_stack, write_report
from bench.pushdown import SCHEMA, build
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.query.spark_source import read_options, spark_session
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

ATTEMPTS = 3


def throughput(spark: Any, options: dict[str, str], work: Path) -> dict[str, Any]:
    """Seconds and rows of the batch read to Parquet, then of the stream to its sink."""
    spark.read.format("vchan").options(**options).load().count()  # warm: workers, imports
    out: dict[str, Any] = {}
    batch_path = str(work / "batch")
    started = time.perf_counter()
    spark.read.format("vchan").options(**options).load().write.parquet(batch_path)
    out["batch_s"] = time.perf_counter() - started
    out["batch_rows"] = pq.ParquetDataset(batch_path).read(columns=["pk"]).num_rows
    print(f"batch: {out['batch_rows']:,} rows in {out['batch_s']:.1f}s", flush=True)

    for attempt in range(1, ATTEMPTS + 1):
        sink, checkpoint = str(work / f"sink{attempt}"), str(work / f"checkpoint{attempt}")
        started = time.perf_counter()
        query = (
            spark.readStream.format("vchan")
            .options(**options, streamId=f"bench-throughput-{attempt}")
            .load()
            .writeStream.format("parquet")
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start(sink)
        )
        try:
            query.awaitTermination()
            break
        except StreamingQueryException as exc:
            # Spark waits 10 s (fixed) for a new Python planner worker to connect back: on a
            # machine at load 40 it did not, and the query failed before reading anything.
            if attempt == ATTEMPTS or "failed to connect back" not in str(exc):
                raise
            print(f"stream attempt {attempt} failed ({str(exc).splitlines()[0][:120]}); again", flush=True)
    out["stream_attempts"] = attempt
    out["stream_s"] = time.perf_counter() - started
    out["stream_batches"] = len([p for p in query.recentProgress if p["numInputRows"]])
    sunk = spark.read.parquet(sink).select("op").toArrow()
    out["stream_rows"] = sunk.num_rows
    out["stream_deletes"] = pc.sum(pc.equal(sunk["op"], "delete")).as_py()
    print(
        f"stream: {out['stream_rows']:,} rows ({out['stream_deletes']:,} deletes) in "
        f"{out['stream_s']:.1f}s, {out['stream_batches']} micro-batches",
        flush=True,
    )
    out["batch_rows_per_s"] = out["batch_rows"] / out["batch_s"]
    out["stream_rows_per_s"] = out["stream_rows"] / out["stream_s"]
    out["stream_over_batch"] = out["stream_rows_per_s"] / out["batch_rows_per_s"]
    return out


class SinkPoller(threading.Thread):
    """When each pk first shows in a Parquet sink's committed files (its metadata log)."""

    def __init__(self, sink: Path) -> None:
        super().__init__(daemon=True)
        self.log = sink / "_spark_metadata"
        self.seen: dict[int, float] = {}
        self._files: set[str] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.poll()
            time.sleep(0.02)

    def poll(self) -> None:
        try:
            entries = sorted(os.listdir(self.log))
        except FileNotFoundError:
            return
        now = time.time()
        for name in entries:
            if name.startswith("."):
                continue
            for line in (self.log / name).read_text().splitlines()[1:]:  # "v1", then a file a line
                path = json.loads(line)["path"].removeprefix("file:")
                if path in self._files:
                    continue
                self._files.add(path)
                for pk in pq.read_table(path, columns=["pk"])["pk"].to_pylist():
                    self.seen.setdefault(pk, now)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def latency(
    spark: Any, system: System, settings_options: dict[str, str], work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    producer = Producer(system)
    info: CollectionInfo = producer.create_collection(f"lat{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    producer.insert(info.name, generate_rows(SCHEMA, 10, start_pk=-10))  # something for the first batch
    sink = work / "lat-sink"

    def start() -> Any:
        return (
            spark.readStream.format("vchan")
            .options(**settings_options, collection=info.name, streamId="bench-latency", upTo="head")
            .load()
            .writeStream.format("parquet")
            .option("checkpointLocation", str(work / "lat-checkpoint"))
            .trigger(processingTime=f"{args.trigger_ms} milliseconds")
            .start(str(sink))
        )

    query = start()
    poller = SinkPoller(sink)
    poller.start()
    acked: list[tuple[int, float]] = []  # (first pk, acknowledged at)
    try:
        restarts = 0
        while -1 not in poller.seen:  # the query runs and has sunk its first batch
            if (failed := query.exception()) is not None:
                # Spark's fixed 10 s for a new Python planner worker to connect back: a loaded
                # machine missed it. Restart from the checkpoint (nothing measured yet).
                if restarts == ATTEMPTS or "failed to connect back" not in str(failed):
                    raise RuntimeError(str(failed))
                restarts += 1
                query = start()
            time.sleep(0.1)
        pk, deadline = 0, time.monotonic() + args.latency_seconds
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            producer.insert(info.name, generate_rows(SCHEMA, args.batch_rows, start_pk=pk, seed=pk))
            acked.append((pk, time.time()))
            pk += args.batch_rows
            next_at += args.interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        last = pk - 1
        wait_until = time.monotonic() + 120
        while last not in poller.seen and time.monotonic() < wait_until:
            time.sleep(0.1)
    finally:
        poller.stop()
        query.stop()
    poller.poll()
    seen = poller.seen
    lags = []
    for first, at in acked:
        times = [seen.get(p) for p in range(first, first + args.batch_rows)]
        if all(t is not None for t in times):
            lags.append(max(t for t in times if t is not None) - at)
    if not lags:
        raise RuntimeError("no insert reached the sink")
    lags.sort()
    out = {
        "trigger_ms": args.trigger_ms,
        "inserts": len(acked),
        "inserts_seen": len(lags),
        "rows_per_insert": args.batch_rows,
        "interval_s": args.interval,
        "latency_p50_s": statistics.median(lags),
        "latency_p95_s": lags[min(len(lags) - 1, int(0.95 * len(lags)))],
        "latency_max_s": lags[-1],
    }
    print(
        f"latency upTo=head, trigger {args.trigger_ms} ms: p50 {out['latency_p50_s']:.2f}s, "
        f"p95 {out['latency_p95_s']:.2f}s, max {out['latency_max_s']:.2f}s "
        f"({len(lags)}/{len(acked)} inserts seen)",
        flush=True,
    )
    return out


def main() -> None:
    parser = bench_parser(__doc__, rows=10_000_000, out="bench/results/stream.json")
    parser.add_argument("--segments", type=int, default=20)
    parser.add_argument("--latency-seconds", type=float, default=30.0)
    parser.add_argument("--trigger-ms", type=int, default=100)
    parser.add_argument("--batch-rows", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    work, etcd, settings = bench_stack("vchan-stream-")
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_before": os.getloadavg()[0],
        "rows": args.rows,
        "segments": args.segments,
    }
    try:
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        store = MetaStore.connect(settings)
        system = System(settings, store, storage)
        spark = spark_session(system)
        options = read_options(settings, store.endpoints)
        with tempfile.TemporaryDirectory(dir=work) as scratch:
            if not args.skip_throughput:
                started = time.perf_counter()
                info = build(system, args.rows, args.segments)
                report["build_s"] = time.perf_counter() - started
                report.update(throughput(spark, {**options, "collection": info.name}, Path(scratch)))
                print(
                    f"stream / batch rows/s: {report['stream_over_batch']:.2f}x (target >= 0.8x)", flush=True
                )
                write_report(args.out, report)  # kept if the latency run fails
            report.update(latency(spark, system, options, Path(scratch), args))
        report["load_after"] = os.getloadavg()[0]
        write_report(args.out, report)
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
