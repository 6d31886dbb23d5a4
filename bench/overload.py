"""Benchmark of write back-pressure: the only DataNode stopped N minutes under full-rate ingest.

    .venv/bin/python -m bench.overload [--minutes 5] [--limit-mb 64] [--producers 2] [--batch 10000]

An embedded etcd, one collection of 2 vchannels, one `vchan datanode --engine local` and
one `vchan datacoord` (real OS processes, VCHAN_WRITE_LAG_LIMIT_MB=--limit-mb), and
--producers threads inserting batches as fast as they can (each its own `Producer`, so its
own back-pressure). Phases:
  1. warm-up (20 s): the node keeps up;
  2. the node stopped (SIGTERM) for --minutes: producers slow from half the limit, then
     are refused with WriteLagExceededError; each second the log bytes after each channel's
     checkpoint are read (the peak must stay near the limit);
  3. a new DataNode started: the time until inserts are accepted again, then 20 s more of
     ingest, then the producers stop, flush, and the time until every checkpoint is at its
     head (caught up);
  4. every acknowledged row is in exactly one binlog (`testing.harness.exactly_once`).
Prints a summary and writes bench/results/overload.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import wait_for
from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Cluster, Produced, all_synced, exactly_once
from vchan_assets.wal.backpressure import MB, WriteLagExceededError, channel_lag
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader

RESULTS = Path(__file__).with_name("results") / "overload.json"


@dataclass(eq=False)
class Load(threading.Thread):
    """One producer inserting batches until stopped; refused batches are not in `produced`."""

    producer: Producer
    info: CollectionInfo
    first_pk: int
    batch: int
    produced: Produced = field(default_factory=Produced)
    refused: int = 0
    first_refusal: str = ""
    refused_at: list[float] = field(default_factory=list)
    accepted_at: list[float] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self.halt = threading.Event()

    def run(self) -> None:
        pk = self.first_pk
        try:
            while not self.halt.is_set():
                rows = generate_rows(SCHEMA, self.batch, start_pk=pk, seed=pk)
                try:
                    self.producer.insert(self.info.name, rows)
                except WriteLagExceededError as exc:
                    self.refused += 1
                    self.first_refusal = self.first_refusal or str(exc)
                    self.refused_at.append(time.monotonic())
                    time.sleep(0.2)  # a client backing off
                    continue
                self.produced.rows.append(rows)
                self.accepted_at.append(time.monotonic())
                pk += self.batch
        except BaseException as exc:
            self.error = exc


def _lags(store: MetaStore, storage: Storage, info: CollectionInfo) -> dict[str, float]:
    return {v: channel_lag(store, WalReader(storage, v, info), info).bytes / MB for v in info.vchannels}


def run(minutes: float, limit_mb: float, producers: int, batch: int, work: Path) -> dict[str, Any]:
    etcd = EmbeddedEtcd(work / "etcd").start()
    settings = replace(
        Settings(),
        home=work / "home",
        root=f"bench-{uuid.uuid4().hex[:8]}",
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(work / "storage"),
        write_lag_limit_mb=limit_mb,
        sync_buffer_mb=8.0,
    )
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    system = System(settings, store, storage)
    info = Producer(system).create_collection("overload", SCHEMA, num_channels=2)
    cluster = Cluster(settings, work, {"VCHAN_WRITE_LAG_LIMIT_MB": str(limit_mb)})
    loads = [Load(Producer(system), info, 1 + i * 10**9, batch) for i in range(producers)]
    out: dict[str, Any] = {"minutes": minutes, "limit_mb": limit_mb, "producers": producers, "batch": batch}
    try:
        node = cluster.node()
        cluster.coordinator()
        for load in loads:
            load.start()
        time.sleep(20)
        warm_rows = sum(load.produced.row_count for load in loads)
        out["warmup_rows_per_s"] = round(warm_rows / 20)
        out["warmup_peak_lag_mb"] = round(max(_lags(store, storage, info).values()), 1)

        node.terminate()
        stopped = time.monotonic()
        rows_at_stop = sum(load.produced.row_count for load in loads)
        peak = 0.0
        while time.monotonic() - stopped < minutes * 60:
            peak = max(peak, *_lags(store, storage, info).values())
            time.sleep(1)
        refusals = [t for load in loads for t in load.refused_at if t > stopped]
        out["stopped_rows_accepted"] = sum(load.produced.row_count for load in loads) - rows_at_stop
        out["stopped_peak_lag_mb"] = round(peak, 1)
        out["first_refusal_after_s"] = round(min(refusals) - stopped, 1) if refusals else None
        out["refused_calls"] = len(refusals)
        out["slowed_calls"] = sum(load.producer.limiter.slowed for load in loads)
        out["slept_s"] = round(sum(load.producer.limiter.slept_seconds for load in loads), 1)
        out["refusal_message"] = next((load.first_refusal for load in loads if load.first_refusal), "")

        cluster.node()
        resumed = time.monotonic()
        out["writes_accepted_again_after_s"] = round(
            wait_for(
                lambda: any(t > resumed for load in loads for t in load.accepted_at), 600, "writes", step=0.2
            ),
            1,
        )
        time.sleep(20)
        for load in loads:
            load.halt.set()
            load.join(120)
            if load.error is not None:
                raise RuntimeError(f"producer failed: {load.error}") from load.error
        flush_at = time.monotonic()
        Producer(system).flush(info.name)
        wait_for(lambda: all_synced(store, storage, [info]), 900, "checkpoints at the heads", step=0.2)
        out["caught_up_after_resume_s"] = round(time.monotonic() - resumed, 1)
        out["synced_after_stop_s"] = round(time.monotonic() - flush_at, 1)
        produced = Produced([t for load in loads for t in load.produced.rows])
        tally = exactly_once(store, storage, info, produced)
        out["rows_acknowledged"] = produced.row_count
        out["exactly_once"] = tally.ok
        if not tally.ok:
            out["tally"] = tally.describe()
    finally:
        for load in loads:
            load.halt.set()
        cluster.cleanup()
        store.close()
        etcd.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the DataNode is stopped")
    parser.add_argument("--limit-mb", type=float, default=64.0, help="VCHAN_WRITE_LAG_LIMIT_MB")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=10_000, help="rows per insert call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        result = run(args.minutes, args.limit_mb, args.producers, args.batch, Path(tmp))
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
