"""Benchmark of DataNode failover: `kill -9` of a node -> first committed sync of one of
its channels on another node, with the default session TTL (10 s).

    .venv/bin/python -m bench.failover [--repeat 3] [--ttl 10]

Each round: an embedded etcd, one collection with 4 vchannels, two `vchan datanode
--engine local` processes and one `vchan datacoord` process (real OS processes), and a
producer writing batches continuously. Once every channel is watched and synced, one
node is killed with SIGKILL; the round measures (from the kill):
  - watch: every channel of the victim is WatchSuccess on the survivor;
  - sync:  the first channel checkpoint of the victim's channels advances (a sync
           committed by the survivor under its new lease).
Prints the median of the rounds and writes bench/results/failover.json. Target: TTL + 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from bench import wait_for
from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, CollectionSchema, MsgPosition, WatchState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import cli_env
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 32}, {"n": "int64"})
VCHAN = Path(sys.executable).parent / "vchan"
RESULTS = Path(__file__).with_name("results") / "failover.json"


def _env(settings: Settings, ttl: float) -> dict[str, str]:
    return cli_env(settings, VCHAN_SESSION_TTL=str(ttl), VCHAN_SYNC_MAX_AGE="0.5")


def spawn(args: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen[str], int]:
    with open(log, "wb") as err:
        proc = subprocess.Popen([str(VCHAN), *args], env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{args[0]} did not start: {log.read_text()[-2000:]}")
    return proc, int(line.split()[1])


def _owners(store: MetaStore) -> dict[str, tuple[int, WatchState]]:
    root = store.keys.channel_watch.prefix
    out = {}
    for kv in store.list_prefix(root).items:
        node, _, vchannel = kv.key[len(root) :].partition("/")
        if node.isdigit():
            info = store.get_model(kv.key, ChannelWatchInfo)
            if info is not None:
                out[vchannel] = (int(node), info.model.state)
    return out


def _checkpoint(store: MetaStore, vchannel: str) -> int:
    found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    return -1 if found is None else found.model.offset


def one_round(etcd: EmbeddedEtcd, work: Path, ttl: float) -> dict[str, float]:
    settings = replace(
        Settings(),
        home=work / "home",
        root=f"bench-{uuid.uuid4().hex[:8]}",
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(work / "storage"),
        session_ttl=ttl,
    )
    store = MetaStore.connect(settings)
    producer = Producer(System(settings, store, Storage.from_settings(settings)))
    info = producer.create_collection("bench", SCHEMA, num_channels=4)
    env = _env(settings, ttl)
    procs: list[subprocess.Popen[str]] = []
    stop = threading.Event()
    try:
        for i in range(2):
            proc, _ = spawn(["datanode", "--engine", "local", "--poll", "0.2"], env, work / f"node{i}.log")
            procs.append(proc)
        node_ids = []
        coord, _ = spawn(["datacoord", "--interval", "0.2"], env, work / "coord.log")
        procs.append(coord)

        def load() -> None:
            pk = 1
            while not stop.is_set():
                producer.insert("bench", generate_rows(SCHEMA, 200, start_pk=pk, seed=pk))
                pk += 200
                time.sleep(0.05)

        writer = threading.Thread(target=load, daemon=True)
        writer.start()

        def watched() -> bool:
            owners = _owners(store)
            return len(owners) == 4 and all(s is WatchState.WATCH_SUCCESS for _, s in owners.values())

        wait_for(watched, 60, "channels watched")
        wait_for(lambda: all(_checkpoint(store, v) >= 0 for v in info.vchannels), 60, "first syncs")
        owners = _owners(store)
        node_ids = sorted({n for n, _ in owners.values()})
        victim_id = max(node_ids, key=lambda n: sum(1 for o, _ in owners.values() if o == n))
        moved = [v for v, (n, _) in owners.items() if n == victim_id]
        # Which process is the victim: node logs name their id.
        victim = next(
            p
            for i, p in enumerate(procs[:2])
            if f"datanode {victim_id} " in (work / f"node{i}.log").read_text()
        )
        before = {v: _checkpoint(store, v) for v in moved}
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        victim.wait()
        first_sync = watch_done = None
        while first_sync is None or watch_done is None:
            now = time.monotonic()
            if now - killed > ttl + 60:
                raise RuntimeError("no failover within TTL + 60 s")
            owners = _owners(store)
            if watch_done is None and all(
                owners.get(v, (victim_id, None))[0] != victim_id and owners[v][1] is WatchState.WATCH_SUCCESS
                for v in moved
            ):
                watch_done = now - killed
            if first_sync is None and any(_checkpoint(store, v) > before[v] for v in moved):
                first_sync = now - killed
            time.sleep(0.02)
        return {"watch_success_s": round(watch_done, 3), "first_sync_s": round(first_sync, 3)}
    finally:
        stop.set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=Settings().session_ttl)
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="vchan-failover-") as tmp:
        etcd = EmbeddedEtcd(Path(tmp) / "etcd").start()
        try:
            for i in range(args.repeat):
                work = Path(tmp) / f"round{i}"
                work.mkdir()
                result = one_round(etcd, work, args.ttl)
                print(
                    f"round {i + 1}: WatchSuccess after {result['watch_success_s']:.2f}s, "
                    f"first committed sync after {result['first_sync_s']:.2f}s",
                    flush=True,
                )
                rounds.append(result)
        finally:
            etcd.stop()
    median_sync = statistics.median(r["first_sync_s"] for r in rounds)
    median_watch = statistics.median(r["watch_success_s"] for r in rounds)
    target = args.ttl + 5
    report = {
        "ttl_s": args.ttl,
        "rounds": rounds,
        "median_watch_success_s": median_watch,
        "median_first_sync_s": median_sync,
        "target_s": target,
        "met": median_sync <= target,
        "setup": "2 local-engine datanodes + 1 datacoord (OS processes), 4 vchannels, producer writing",
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"failover (TTL {args.ttl:g}s, median of {len(rounds)}): WatchSuccess {median_watch:.2f}s, "
        f"first committed sync {median_sync:.2f}s (target {target:g}s: {'met' if report['met'] else 'MISSED'})"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
