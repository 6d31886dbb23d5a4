"""Benchmark of the graceful stop (node states, docs/operations.md): a rolling restart of the
DataNodes under load, the DataCoord hand-over to its standby, and a freshly started
Spark DataNode's first insert+flush.

    .venv/bin/python -m bench.rolling [--nodes 3] [--producers 2] [--channels 4]
        [--coord-rounds 3] [--spark-rows 1000000] [--parts rolling,datacoord,spark]

Real OS processes (`vchan datanode --engine local`, `vchan datacoord`) on an embedded
etcd with the default session TTL (so anything faster than it is the graceful path):

- rolling: `--nodes` DataNodes and a DataCoord; `--producers` threads insert (and delete)
  as fast as they can. Each original node in turn gets SIGTERM, exits, and a new node is
  started and waited for (HEALTHY) before the next one goes. A sampler (every 20 ms)
  records per vchannel the longest time without a syncing owner (a WatchSuccess of a
  HEALTHY node under the channel's current lease; target <= 2 s) and the peak checkpoint
  lag (log head minus checkpoint, in messages and seconds); per SIGTERM, the time until
  every channel of the node was WatchSuccess on another node. At the end: every row and
  delete in exactly one binlog.
- datacoord: two `vchan datacoord`; the active one gets SIGTERM; the time until the
  standby holds the election key (target <= 1 s). Repeated `--coord-rounds` times.
- spark: a fresh `vchan datanode --engine spark` (and a DataCoord); once it is HEALTHY
  (its Spark session was started at launch), `--spark-rows` rows are inserted and the
  collection flushed; the time from the first insert until every channel's checkpoint
  reached the log head (persisted), and how long the node took to go HEALTHY.

Writes bench/results/rolling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import wait_for
from bench.failover import spawn
from vchan_assets.config import Settings
from vchan_assets.meta.channelwatch import list_watches
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    ChannelLease,
    ChannelWatchInfo,
    CollectionInfo,
    MsgPosition,
    NodeSession,
    SessionState,
    WatchState,
    physical_ms,
)
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced, all_synced, cli_env, exactly_once, produce
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader

RESULTS = Path(__file__).with_name("results") / "rolling.json"


def _sessions(store: MetaStore) -> dict[int, NodeSession]:
    found, _ = store.list_models(store.keys.datanode_session.prefix, NodeSession, skip_malformed=True)
    return {d.model.node_id: d.model for d in found}


def _healthy(store: MetaStore, node_id: int) -> bool:
    s = _sessions(store).get(node_id)
    return s is not None and s.state is SessionState.HEALTHY


def _watches(store: MetaStore) -> list[tuple[int, str, ChannelWatchInfo]]:
    return [(e.node_id, e.vchannel, e.info) for e in list_watches(store).entries]


def _states(store: MetaStore) -> list[tuple[int, str, WatchState]]:
    return [(n, v, info.state) for n, v, info in _watches(store)]


def _leases(store: MetaStore) -> dict[str, ChannelLease]:
    prefix = store.keys.channel_lease.prefix
    found, _ = store.list_models(prefix, ChannelLease, skip_malformed=True)
    return {d.kv.key[len(prefix) :]: d.model for d in found}


def _checkpoint(store: MetaStore, vchannel: str) -> MsgPosition | None:
    found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    return None if found is None else found.model


def _syncing_owners(store: MetaStore, releasing: bool = False) -> dict[str, int]:
    """vchannel -> the HEALTHY node holding it in WatchSuccess (or, with `releasing`, in
    ToRelease: doing its last sync before a balance move) under its current lease."""
    sessions, leases = _sessions(store), _leases(store)
    states = (WatchState.WATCH_SUCCESS, WatchState.TO_RELEASE) if releasing else (WatchState.WATCH_SUCCESS,)
    out = {}
    for node, vchannel, info in _watches(store):
        s, lease = sessions.get(node), leases.get(vchannel)
        if info.state not in states or s is None or s.state is not SessionState.HEALTHY:
            continue
        if info.lease_id is None or (lease is not None and lease.lease_id == info.lease_id):
            out[vchannel] = node
    return out


@dataclass(eq=False)
class Sampler(threading.Thread):
    """Every 20 ms (as fast as etcd answers): which channels have a syncing owner (longest
    gap per channel; gaps over 1 s are listed with when they started and what etcd said
    then); every 0.5 s: each channel's checkpoint lag (peak)."""

    store: MetaStore
    storage: Storage
    info: CollectionInfo
    gaps: dict[str, float] = field(default_factory=dict)
    lag_messages: dict[str, int] = field(default_factory=dict)
    lag_seconds: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    long_gaps: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        without: dict[str, tuple[float, str]] = {}
        last_lag = 0.0
        t0 = self.t0
        while not self.halt.is_set():
            now = time.monotonic()
            owners = _syncing_owners(self.store, releasing=True)
            self.samples += 1
            for v in self.info.vchannels:
                if v in owners:
                    gap = without.pop(v, None)
                    if gap is not None:
                        self._gap(v, gap, now, t0)
                elif v not in without:
                    seen = [f"{st.value} on {n}" for n, c, st in _states(self.store) if c == v]
                    without[v] = (now, ", ".join(seen) or "no watch info")
            if now - last_lag >= 0.5:
                last_lag = now
                self._lag()
            time.sleep(0.02)
        now = time.monotonic()
        for v, gap in without.items():
            self._gap(v, gap, now, t0)

    def _gap(self, v: str, gap: tuple[float, str], now: float, t0: float) -> None:
        start, seen = gap
        self.gaps[v] = max(self.gaps.get(v, 0.0), now - start)
        if now - start > 1:
            self.long_gaps.append(
                {"vchannel": v, "at_s": round(start - t0, 1), "gap_s": round(now - start, 2), "etcd": seen}
            )

    def _lag(self) -> None:
        for v in self.info.vchannels:
            head = WalReader(self.storage, v, self.info).head()
            cp = _checkpoint(self.store, v)
            if head is None:
                continue
            messages = head.offset - (cp.offset if cp else -1)
            seconds = (physical_ms(head.timestamp) - (physical_ms(cp.timestamp) if cp else 0)) / 1000
            self.lag_messages[v] = max(self.lag_messages.get(v, 0), messages)
            if cp is not None:
                self.lag_seconds[v] = max(self.lag_seconds.get(v, 0.0), seconds)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


class Producers:
    """`count` threads inserting (and deleting a few) rows as fast as they can."""

    def __init__(self, settings: Settings, name: str, count: int, rows: int = 500) -> None:
        self.name = name
        self.rows = rows
        self.produced = [Produced() for _ in range(count)]
        self.stores = [MetaStore.connect(settings) for _ in range(count)]
        self.producers = [Producer(System(settings, s, Storage.from_settings(settings))) for s in self.stores]
        self.halt = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True, name=f"producer {i}")
            for i in range(count)
        ]

    def _run(self, i: int) -> None:
        pk = 1 + i * 1_000_000_000
        try:
            while not self.halt.is_set():
                produce(self.producers[i], self.name, self.produced[i], self.rows, pk, deletes=2)
                pk += self.rows
        except BaseException as exc:
            self.errors.append(exc)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> Produced:
        self.halt.set()
        for t in self.threads:
            t.join(60)
        self.producers[0].time_tick(self.name)
        for s in self.stores:
            s.close()
        if self.errors:
            raise RuntimeError(f"a producer failed: {self.errors[0]!r}")
        every = Produced()
        for p in self.produced:
            every.rows.extend(p.rows)
            every.deleted.extend(p.deleted)
        return every


def _settings(etcd: EmbeddedEtcd, work: Path) -> Settings:
    return replace(
        Settings(),
        home=work / "home",
        root=f"bench-{uuid.uuid4().hex[:8]}",
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(work / "storage"),
        sync_max_age=0.5,
    )


def _kill_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def rolling(etcd: EmbeddedEtcd, work: Path, nodes: int, producers: int, channels: int) -> dict[str, Any]:
    settings = _settings(etcd, work)
    env = cli_env(settings)
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    info = Producer(System(settings, store, storage)).create_collection(
        "rolling", SCHEMA, num_channels=channels
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        coord, _ = spawn(["datacoord", "--interval", "0.5"], env, work / "coord.log")
        procs.append(coord)
        running: list[tuple[subprocess.Popen[str], int]] = []
        for i in range(nodes):
            running.append(spawn(["datanode", "--engine", "local"], env, work / f"node{i}.log"))
            procs.append(running[-1][0])
        wait_for(lambda: len(_syncing_owners(store)) == channels, 60, "every channel watched")
        load = Producers(settings, info.name, producers)
        load.start()
        wait_for(lambda: all(_checkpoint(store, v) for v in info.vchannels), 60, "first syncs", 0.1)
        sampler = Sampler(store, storage, info)
        sampler.start()
        time.sleep(10)  # the lag under this load without restarts
        baseline = max(sampler.lag_seconds.values(), default=0.0)
        sampler.lag_seconds.clear()
        sampler.lag_messages.clear()
        handovers = []
        started = time.monotonic()
        for i in range(nodes):
            proc, node_id = running.pop(0)
            held = [v for v, n in _syncing_owners(store).items() if n == node_id]
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)

            def moved(held: list[str] = held, node_id: int = node_id) -> bool:
                now = _syncing_owners(store)
                return all(now.get(v, node_id) != node_id for v in held)

            wait_for(moved, 60, f"node {node_id}'s channels moved")
            handover = time.monotonic() - sent
            exit_code = proc.wait(120)
            exited = time.monotonic() - sent
            handovers.append(
                {
                    "node": node_id,
                    "channels": len(held),
                    "handover_s": round(handover, 3),
                    "sigterm_at_s": round(sent - sampler.t0, 1),
                    "exit_s": round(exited, 3),
                }
            )
            print(
                f"node {node_id}: {len(held)} channels on other nodes {handover:.2f}s after SIGTERM, "
                f"exited ({exit_code}) after {exited:.2f}s",
                flush=True,
            )
            new = spawn(["datanode", "--engine", "local"], env, work / f"node{nodes + i}.log")
            procs.append(new[0])
            running.append(new)
            wait_for(lambda new_id=new[1]: _healthy(store, new_id), 60, "the new node HEALTHY")
            time.sleep(2)  # let balance move channels onto it before the next one goes
        roll_s = time.monotonic() - started
        produced = load.stop()
        wait_for(lambda: all_synced(store, storage, [info]), 120, "every channel synced to its head", 0.2)
        sampler.stop()
        tally = exactly_once(store, storage, info, produced)
        return {
            "nodes": nodes,
            "producers": producers,
            "channels": channels,
            "rows": produced.row_count,
            "deletes": len(produced.deleted),
            "roll_s": round(roll_s, 1),
            "handovers": handovers,
            "max_gap_without_syncing_owner_s": {v: round(g, 3) for v, g in sorted(sampler.gaps.items())},
            "worst_gap_s": round(max(sampler.gaps.values(), default=0.0), 3),
            "peak_lag_messages": max(sampler.lag_messages.values(), default=0),
            "peak_lag_seconds": round(max(sampler.lag_seconds.values(), default=0.0), 2),
            "baseline_peak_lag_seconds": round(baseline, 2),
            "samples": sampler.samples,
            "gaps_over_1s": sampler.long_gaps,
            "exactly_once": tally.ok,
            "tally": tally.describe() if not tally.ok else "ok",
        }
    finally:
        _kill_all(procs)
        store.close()


def datacoord_handover(etcd: EmbeddedEtcd, work: Path, rounds: int) -> dict[str, Any]:
    settings = _settings(etcd, work)
    env = cli_env(settings)
    store = MetaStore.connect(settings)
    key = store.keys.datacoord_session()
    procs: list[subprocess.Popen[str]] = []
    took = []
    try:
        active, _ = spawn(["datacoord"], env, work / "coord-a.log")
        procs.append(active)
        wait_for(lambda: store.get(key) is not None, 30, "a leader")
        for i in range(rounds):
            standby, _ = spawn(["datacoord"], env, work / f"coord-{i}.log")
            procs.append(standby)
            time.sleep(1.5)  # the standby campaigns
            held = store.get(key)
            assert held is not None
            sent = time.monotonic()
            active.send_signal(signal.SIGTERM)

            def replaced(old: int = held.create_revision) -> bool:
                now = store.get(key)
                return now is not None and now.create_revision != old

            wait_for(replaced, 30, "the standby leads", 0.005)
            took.append(round(time.monotonic() - sent, 3))
            active.wait(30)
            print(f"datacoord round {i + 1}: the standby leads {took[-1]:.3f}s after SIGTERM", flush=True)
            active = standby
    finally:
        _kill_all(procs)
        store.close()
    return {"rounds": took, "max_s": max(took), "median_s": sorted(took)[len(took) // 2]}


def spark_first_flush(etcd: EmbeddedEtcd, work: Path, rows: int, channels: int) -> dict[str, Any]:
    settings = _settings(etcd, work)
    env = cli_env(settings, VCHAN_SYNC_MAX_AGE="2")
    store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    producer = Producer(System(settings, store, storage))
    info = producer.create_collection("spark", SCHEMA, num_channels=channels)
    procs: list[subprocess.Popen[str]] = []
    try:
        coord, _ = spawn(["datacoord", "--interval", "0.5"], env, work / "coord.log")
        procs.append(coord)
        launched = time.monotonic()
        node, node_id = spawn(["datanode", "--engine", "spark"], env, work / "spark-node.log")
        procs.append(node)
        wait_for(lambda: _healthy(store, node_id), 300, "the Spark node HEALTHY", 0.05)
        healthy_s = time.monotonic() - launched
        wait_for(lambda: len(_syncing_owners(store)) == channels, 60, "every channel watched")
        started = time.monotonic()
        batch = 50_000
        for pk in range(1, rows + 1, batch):
            producer.insert(info.name, generate_rows(SCHEMA, min(batch, rows + 1 - pk), start_pk=pk, seed=pk))
        producer.flush(info.name)
        produced_s = time.monotonic() - started
        wait_for(lambda: all_synced(store, storage, [info]), 600, "persisted", 0.1)
        persisted_s = time.monotonic() - started
        print(
            f"spark node HEALTHY {healthy_s:.1f}s after launch; {rows:,} rows produced in {produced_s:.1f}s, "
            f"persisted {persisted_s:.1f}s after the first insert",
            flush=True,
        )
        return {
            "rows": rows,
            "healthy_after_launch_s": round(healthy_s, 1),
            "produce_s": round(produced_s, 1),
            "insert_flush_persisted_s": round(persisted_s, 1),
        }
    finally:
        _kill_all(procs)
        store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--coord-rounds", type=int, default=3)
    parser.add_argument("--spark-rows", type=int, default=1_000_000)
    parser.add_argument("--parts", default="rolling,datacoord,spark", help="which parts to run")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    report: dict[str, Any] = {"machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"}
    with tempfile.TemporaryDirectory(prefix="vchan-rolling-") as tmp:
        etcd = EmbeddedEtcd(Path(tmp) / "etcd").start()
        try:
            for part in parts:
                work = Path(tmp) / part
                work.mkdir()
                report[part] = _run_part(part, etcd, work, args)
        finally:
            etcd.stop()
    results = RESULTS if len(parts) == 3 else RESULTS.with_stem("rolling-" + "-".join(parts))
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {results}")


def _run_part(part: str, etcd: EmbeddedEtcd, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    if part == "rolling":
        r = rolling(etcd, work, args.nodes, args.producers, args.channels)
        print(
            f"rolling restart of {r['nodes']} nodes under {r['producers']} producers ({r['rows']:,} rows): "
            f"worst gap without a syncing owner {r['worst_gap_s']:.2f}s (target 2 s), peak checkpoint lag "
            f"{r['peak_lag_messages']} messages / {r['peak_lag_seconds']}s (10 s before the restarts: "
            f"{r['baseline_peak_lag_seconds']}s), exactly once: {r['exactly_once']}"
        )
        return r
    if part == "datacoord":
        d = datacoord_handover(etcd, work, args.coord_rounds)
        print(f"datacoord SIGTERM -> standby leads: max {d['max_s']:.3f}s (target 1 s)")
        return d
    if part == "spark":
        return spark_first_flush(etcd, work, args.spark_rows, args.channels)
    raise SystemExit(f"unknown part {part!r}: rolling, datacoord or spark")


if __name__ == "__main__":
    main()
