"""Benchmark: the time of a 1-row sync against the number of files the channel's log has had.

    .venv/bin/python -m bench.log_length [--files 1000,10000,100000] [--s3-files 1000,10000]
                                          [--repeat 5]

For each length N, one vchannel's log gets N small files below its checkpoint (the history
a busy channel leaves); then, in rounds over every channel (so the machine's load falls on
every length alike), one row is inserted through the producer and synced:
  - sync (local): the real SyncTask in-process, without Spark (the log-reading share shows);
  - sync (spark): the same task on a warm local Spark session;
  - whole log: `WalReader.files()`, one footer read per file: what every sync paid before
    it found its files by name (up to `--whole-log-max` files: 100k take minutes).
The history files are real log files encoded by the project's writer (a time tick each),
written without fsync to build 100k of them quickly; the checkpoint is put after them.
Then the same on the moto S3 server (`--s3-files`, local engine). Figures: median seconds;
the flatness ratio is the largest log's median over the smallest's (1.0 = flat).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from bench import bench_stack
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.embedded import free_port
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition
from vchan_assets.spark import Engine
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.format import MsgType, wal_key
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader
from vchan_assets.wal.writer import WalWriter

SCHEMA = CollectionSchema.build("pk", {"vec": 128}, {"n": "int64", "s": "string"})


def grow_history(storage: Storage, store: MetaStore, info: CollectionInfo, files: int) -> None:
    """Append tick-only log files until the channel has `files` files, then put the channel
    checkpoint at the last one (as if every file had been synced)."""
    vchannel = info.vchannels[0]
    writer = WalWriter(storage, vchannel, info)
    writer.refresh()
    first, ts = writer.next_offset, writer.last_timestamp
    have = len(storage.list_keys(f"wal/{vchannel}/"))
    for offset in range(first, first + files - have):
        ts += 1
        tick = pa.table({"msg_type": [MsgType.TIME_TICK.value], "timestamp": pa.array([ts], pa.int64())})
        key = wal_key(vchannel, offset)
        table = writer._conform(tick, storage.path(key), offset, writer.schema)
        data = writer._encode(table, writer._footer(offset, 1, ts))
        if storage.is_s3:
            storage.write_atomic(key, data)
        else:
            Path(storage.path(key)).write_bytes(memoryview(data))  # no fsync: setup, not measured
    writer.refresh()
    store.put(store.keys.channel_checkpoint(vchannel), MsgPosition(vchannel, writer.next_offset - 1, ts))


def one_row_sync(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, info: CollectionInfo,
    engine: Engine, pk: int,
) -> float:  # fmt: skip
    """Insert one row through the producer, then time its sync."""
    vchannel = info.vchannels[0]
    WalWriter(storage, vchannel, info).refresh()
    producer.insert(info.name, generate_rows(SCHEMA, 1, start_pk=pk, seed=pk))
    lease = store.read_lease(vchannel) or grant_channel_lease(store, IdAllocator(store), vchannel, 1)
    started = time.perf_counter()
    result = SyncTask(System(settings, store, storage), info, vchannel, lease, engine=engine).run()
    seconds = time.perf_counter() - started
    assert result.rows == 1, result
    return seconds


def whole_log(storage: Storage, info: CollectionInfo) -> float:
    started = time.perf_counter()
    WalReader(storage, info.vchannels[0], info).files()
    return time.perf_counter() - started


def measure(
    store: MetaStore, storage: Storage, settings: Settings, lengths: list[int], engines: list[Engine],
    repeat: int, label: str, whole_log_max: int,
) -> dict[str, Any]:  # fmt: skip
    """One channel per log length; then rounds of 1-row syncs over every channel and
    engine in turn, so that the machine's load falls on every length alike."""
    producer = Producer(System(settings, store, storage))
    channels = {}
    out: dict[str, Any] = {}
    for files in lengths:
        info = producer.create_collection(f"len{files}_{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
        started = time.perf_counter()
        grow_history(storage, store, info, files)
        channels[files] = info
        out[str(files)] = {"build_s": round(time.perf_counter() - started, 1)}
        print(f"{label}: built a log of {files:,} files in {out[str(files)]['build_s']}s", flush=True)
    runs: dict[tuple[int, str], list[float]] = {(n, e): [] for n in lengths for e in engines}
    pk = 0
    for engine in engines:  # Spark's Python workers started before anything is timed
        pk += 1
        one_row_sync(store, storage, settings, producer, channels[lengths[0]], engine, pk)
    for _ in range(repeat):
        for files, info in channels.items():
            for engine in engines:
                pk += 1
                runs[(files, engine)].append(
                    one_row_sync(store, storage, settings, producer, info, engine, pk)
                )
    for files, info in channels.items():
        row = out[str(files)]
        for engine in engines:
            measured = runs[(files, engine)]
            row[engine] = {"median_s": statistics.median(measured), "runs_s": [round(r, 3) for r in measured]}
        row["whole_log_s"] = whole_log(storage, info) if files <= whole_log_max else None
        figures = "  ".join(f"{e} {row[e]['median_s']:.3f}s" for e in engines)
        whole = f"{row['whole_log_s']:.2f}s" if row["whole_log_s"] is not None else "not measured"
        print(f"{label} {files:>7,} files: 1-row sync {figures}  whole-log describe {whole}", flush=True)
    for engine in engines:
        first, last = out[str(lengths[0])][engine]["median_s"], out[str(lengths[-1])][engine]["median_s"]
        out[f"flatness_{engine}"] = last / first
        print(f"{label} {engine}: {lengths[-1]:,} files / {lengths[0]:,} files = {last / first:.2f}x")
    return out


class MotoServer:
    """The moto S3 server on loopback, with one bucket (test credentials in os.environ)."""

    def __init__(self, logfile: Path) -> None:
        self.endpoint = f"http://127.0.0.1:{free_port()}"
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
        binary = Path(sys.executable).parent / "moto_server"
        with open(logfile, "wb") as out:
            self.process = subprocess.Popen(
                [str(binary), "-H", "127.0.0.1", "-p", self.endpoint.rsplit(":", 1)[1]],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start; see {logfile}") from None
                time.sleep(0.1)
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket="bench")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", default="1000,10000,100000")
    parser.add_argument("--s3-files", default="1000,10000", help="'' to skip the S3 server")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--whole-log-max", type=int, default=10_000, help="describe the whole log only up to this length"
    )
    parser.add_argument("--out", default="bench/results/log_length.json")
    args = parser.parse_args()

    work, etcd, settings = bench_stack("vchan-bench-loglen-")
    settings = replace(settings, sync_in_process_mb=0.0)  # "spark" runs are Spark jobs, however small
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    report: dict[str, Any] = {}
    try:
        get_spark(settings)
        lengths = [int(n) for n in args.files.split(",")]
        report["local"] = measure(
            store, storage, settings, lengths, ["local", "spark"], args.repeat, "local", args.whole_log_max
        )
        if args.s3_files:
            moto = MotoServer(work / "moto.log")
            try:
                s3 = replace(settings, storage_uri="s3://bench/log", s3_endpoint=moto.endpoint)
                s3_lengths = [int(n) for n in args.s3_files.split(",")]
                report["s3"] = measure(
                    store, Storage.from_settings(s3), s3, s3_lengths, ["local"], args.repeat, "s3", 1000
                )
            finally:
                moto.stop()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"written {args.out}")
    finally:
        store.close()
        etcd.stop()


if __name__ == "__main__":
    main()
