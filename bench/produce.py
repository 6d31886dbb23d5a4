"""Benchmark of many producers on one collection (docs/multi-writer.md).

    .venv/bin/python -m bench.produce [--rows 400000] [--producers 1,2,4] [--e2e-rows 1000000]

In one run, on one scratch etcd and storage directory, a collection with a 128-d float
vector and 2 vchannels, 10,000-row batches:
  - baseline: one process appending the same batches through the single-writer path
    (`WalWriter.append`: in-process tail, no etcd lock, segment IDs given) — what one
    producer cost before the multi-writer log, minus its in-memory segment assignment;
  - 1, 2, 4 producer processes (`Producer.insert`, the multi-writer path), each its own
    OS process, started together: aggregate rows/s, and the ratio to the baseline;
  - coordination cost per batch and channel: (1 producer - baseline) / appends; and, per
    configuration, the append lock's critical section (taken to released) and the acquire
    call (round trip and waits) per append, as the producers measure them;
  - end to end: `--e2e-rows` rows by 1 and by 2 producers, then flush, then the sync
    (local engine, one channel after the other) until `flush_state` is true.
Each configuration runs `--repeat` times, interleaved with the others; medians are reported.
Rows are generated once per process before the clock starts (pks are renumbered per batch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench import bench_stack
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.format import MsgType
from vchan_assets.wal.producer import Producer, _batch_schema, generate_rows, to_insert_table
from vchan_assets.wal.writer import WalWriter

SCHEMA = CollectionSchema.build("pk", {"vec": 128}, {"n": "int64", "f": "float", "s": "string"})
BATCH = 10_000


def _batches(rows: int, start_pk: int) -> list[pa.Table]:
    template = generate_rows(SCHEMA, BATCH, seed=start_pk)
    out = []
    for first in range(start_pk, start_pk + rows, BATCH):
        pks = pa.array(np.arange(first, first + BATCH, dtype=np.int64))
        out.append(template.set_column(0, "pk", pks))
    return out


def child(settings: Settings, collection: str, rows: int, start_pk: int, go: Path) -> None:
    """One producer process: prepare, wait for `go`, insert, print start and end times."""
    store = MetaStore.connect(settings)
    producer = Producer(System(settings, store, Storage.from_settings(settings)))
    producer.collection(collection)
    batches = _batches(rows, start_pk)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    started = time.time()
    for batch in batches:
        producer.insert(collection, batch)
    end = time.time()
    timings = {k: [t.count, t.seconds] for k, t in producer.lock_timings().items()}
    print(json.dumps({"start": started, "end": end, **timings}), flush=True)
    producer.close()
    store.close()


@dataclass(frozen=True)
class ProducerRun:
    """What `n` producer processes did together: aggregate rows/s, the ms per append the
    lock was held and acquiring took (means over every append), and the wall-clock
    (`time.time()`) span from the first insert to the last."""

    rows_per_s: float
    lock_ms: dict[str, float]
    started: float
    ended: float


def run_producers(settings: Settings, work: Path, collection: str, n: int, rows: int) -> ProducerRun:
    """`n` producer processes inserting `rows` in all, started together."""
    go = work / f"go-{uuid.uuid4().hex[:6]}"
    path = os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))
    env = {**settings.to_env(), "PATH": str(Path(sys.executable).parent), "PYTHONPATH": path}
    procs = []
    for k in range(n):
        args = [
            sys.executable,
            "-m",
            "bench.produce",
            "--child",
            collection,
            str(rows // n),
            str(k * 10**9),
            str(go),
        ]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True))
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", "a producer failed to start"
    go.touch()
    spans = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, f"producer failed: {proc.returncode}"
        spans.append(json.loads(out.strip().splitlines()[-1]))
    started, ended = min(s["start"] for s in spans), max(s["end"] for s in spans)
    ms = {k: 1000 * sum(s[k][1] for s in spans) / sum(s[k][0] for s in spans) for k in ("held", "acquiring")}
    return ProducerRun((rows // n) * n / (ended - started), ms, started, ended)


def run_baseline(settings: Settings, store: MetaStore, storage: Storage, collection: str, rows: int) -> float:
    """The single-writer path: route, build, `WalWriter.append`; no etcd per batch."""
    producer = Producer(System(settings, store, storage))
    info = producer.collection(collection)
    writers = {v: WalWriter(storage, v, info) for v in info.vchannels}
    batches = _batches(rows, 5 * 10**9)
    started = time.perf_counter()
    ts = producer.tso.now()
    for batch in batches:
        table = to_insert_table(info.schema, batch)
        for vchannel, part in producer._route(info, table, table.column("pk")):
            n = part.num_rows
            ts += 2
            system = [
                pa.repeat(pa.scalar(MsgType.INSERT.value), n),
                pa.array(np.full(n, ts - 1, dtype=np.int64)),
                pa.array(np.full(n, 1, dtype=np.int64)),
                pa.array(np.full(n, info.partitions[0], dtype=np.int64)),
                pa.nulls(n, pa.string()),
            ]
            rows_table = pa.Table.from_arrays([*system, *part.columns], schema=_batch_schema(info))
            tick = producer._control_table(info, MsgType.TIME_TICK, ts)
            writers[vchannel].append(pa.concat_tables([rows_table, tick]))
    return rows / (time.perf_counter() - started)


def end_to_end(
    settings: Settings, work: Path, store: MetaStore, storage: Storage, producers: int, rows: int
) -> float:
    """Seconds from the first insert until `flush_state` is true (inserts by `producers`
    processes, then flush, then the local sync of every channel)."""
    producer = Producer(System(settings, store, storage))
    info = producer.create_collection(f"e2e{producers}_{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    started = time.perf_counter()
    run_producers(settings, work, info.name, producers, rows)
    flush_ts = producer.flush(info.name)
    ids = IdAllocator(store)
    for vchannel in info.vchannels:
        lease = grant_channel_lease(store, ids, vchannel, node_id=1)
        SyncTask(System(settings, store, storage), info, vchannel, lease, engine="local").run()
    assert producer.flush_state(info.name, flush_ts), "flush did not complete"
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.produce")
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--producers", default="1,2,4")
    parser.add_argument("--e2e-rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        collection, rows, start_pk, go = args.child
        child(Settings.from_env(), collection, int(rows), int(start_pk), Path(go))
        return
    work, etcd, settings = bench_stack("vchan-bench-produce-")
    try:
        store = MetaStore.connect(settings)
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        producer = Producer(System(settings, store, storage))
        counts = [int(x) for x in args.producers.split(",")]
        runs: dict[str, list[float]] = {"baseline": [], **{f"{n} producers": [] for n in counts}}
        locks: dict[str, list[float]] = {
            f"{n} producers {k}": [] for n in counts for k in ("held", "acquiring")
        }
        for r in range(args.repeat):  # interleaved, so a change of load hits every configuration
            base = producer.create_collection(f"baseline{r}", SCHEMA, num_channels=2)
            runs["baseline"].append(run_baseline(settings, store, storage, base.name, args.rows))
            for n in counts:
                info = producer.create_collection(f"p{n}_{r}", SCHEMA, num_channels=2)
                run = run_producers(settings, work, info.name, n, args.rows)
                runs[f"{n} producers"].append(run.rows_per_s)
                for k, v in run.lock_ms.items():
                    locks[f"{n} producers {k}"].append(v)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in runs.items()), flush=True)
        results = {f"{k} rows/s": statistics.median(v) for k, v in runs.items()}
        base_rate = results["baseline rows/s"]
        print(f"baseline (single-writer path, 1 process): {base_rate:,.0f} rows/s")
        for n in counts:
            rate = results[f"{n} producers rows/s"]
            one_rate = results.get("1 producers rows/s", rate)
            held, acquiring = (statistics.median(locks[f"{n} producers {k}"]) for k in ("held", "acquiring"))
            results[f"{n} producers lock held ms"] = held
            results[f"{n} producers acquire ms"] = acquiring
            print(
                f"{n} producer process(es): {rate:,.0f} rows/s = {rate / base_rate:.2f}x baseline, "
                f"{rate / one_rate:.2f}x one producer; per append: lock held {held:.1f} ms, "
                f"acquire (round trip and waits) {acquiring:.1f} ms"
            )
        one = results.get("1 producers rows/s")
        if one:
            appends = args.rows / BATCH * 2  # one append per channel per batch
            cost_ms = (args.rows / one - args.rows / base_rate) / appends * 1000
            results["coordination ms per append"] = cost_ms
            print(f"coordination cost: {cost_ms:.2f} ms per batch and channel (1 producer vs baseline)")
        e2e: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.repeat):
            for n in e2e:
                e2e[n].append(end_to_end(settings, work, store, storage, n, args.e2e_rows))
        for n, seconds in e2e.items():
            results[f"e2e {n} producers s"] = statistics.median(seconds)
            print(
                f"end to end, {args.e2e_rows:,} rows by {n} producer(s), flushed and synced: "
                f"{statistics.median(seconds):.1f}s (median; runs {', '.join(f'{x:.1f}' for x in seconds)})"
            )
        print(json.dumps(results))
        store.close()
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
