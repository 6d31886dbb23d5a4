"""Planning past one machine, by simulation: the channel manager with 1,000 vchannels and
100 DataNodes on a real etcd, then 10 of those nodes dying at once.

    .venv/bin/python -m bench.scale [--channels 1000] [--nodes 100] [--dead 10] [--ttl 10]

What is real: the etcd (embedded, its own process), the catalog's collections, the
`ChannelManager.reconcile` step the coordinator and the DataCoord sensor run, the
DataNode sessions (a `Session` each: an etcd lease kept alive by its own thread, with
the TTL of a real node) and the Dagster DataCoord sensor. What is simulated: the
DataNodes' answers. Between two steps every simulated node does what a real node does
to its watch infos (ToWatch -> WatchSuccess, ToRelease -> ReleaseSuccess, each a
compare-and-swap), without syncing anything.

Measured:
  - assignment from scratch: steps until every channel is WatchSuccess, time and etcd
    requests of each step (etcd's own counters: `grpc_server_handled_total` of the KV
    and lease methods; the sessions' keep-alive streams are left out);
  - a steady step (nothing to do): median time and etcd requests;
  - keys and bytes under the root in etcd, by kind, and etcd's database size;
  - the Dagster DataCoord sensor's tick (a `build_sensor_context` evaluation, opening
    its runtime as the daemon does), steady;
  - failover: the sessions of `--dead` nodes stop their keep-alive at once (a crash):
    time until etcd drops them, and until each of their channels is WatchSuccess on a
    live node again, steps taken, slowest step. Target: TTL + 10 s.
Writes bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import bench_stack
from vchan_assets.config import Settings
from vchan_assets.datacoord.channel_manager import ChannelManager, ReconcileReport
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.channelwatch import list_watches
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema, NodeSession, WatchState

SCHEMA = CollectionSchema.build("pk", {"vec": 32}, {"n": "int64"})
RESULTS = Path(__file__).with_name("results") / "scale.json"
COUNTED = ("Range", "Txn", "Put", "DeleteRange", "LeaseGrant", "LeaseRevoke")
STEP_INTERVAL = 0.5  # the coordinator's loop interval
ANSWERS = {WatchState.TO_WATCH: WatchState.WATCH_SUCCESS, WatchState.TO_RELEASE: WatchState.RELEASE_SUCCESS}


def etcd_requests(endpoint: str) -> int:
    """KV and lease requests etcd has handled so far (its Prometheus counters)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{"):
            method = re.search(r'grpc_method="(\w+)"', line)
            if method and method.group(1) in COUNTED:
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def answer(store: MetaStore, live: set[int]) -> int:
    """Every live simulated node answers its ToWatch / ToRelease infos; how many."""
    answered = 0
    for e in list_watches(store).entries:
        new_state = ANSWERS.get(e.info.state)
        if e.node_id not in live or new_state is None:
            continue
        try:
            store.cas(e.kv.key, e.kv.version, replace(e.info, state=new_state, progress=100))
            answered += 1
        except CasConflictError:
            pass
    return answered


def watched(store: MetaStore, live: set[int]) -> dict[str, int]:
    """vchannel -> node, for channels that are WatchSuccess on a live node."""
    return {
        e.vchannel: e.node_id
        for e in list_watches(store).entries
        if e.node_id in live and e.info.state is WatchState.WATCH_SUCCESS
    }


class Stepper:
    """Reconcile steps on one etcd, each timed and counted."""

    def __init__(self, store: MetaStore, settings: Settings, endpoint: str) -> None:
        self.manager = ChannelManager(store, settings)
        self.store = store
        self.endpoint = endpoint

    def step(self) -> tuple[ReconcileReport, float, int]:
        before = etcd_requests(self.endpoint)
        started = time.perf_counter()
        report = self.manager.reconcile()
        seconds = time.perf_counter() - started
        return report, seconds, etcd_requests(self.endpoint) - before


def etcd_footprint(store: MetaStore) -> dict[str, Any]:
    snap = store.list_prefix(store.keys.root + "/")
    kinds: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for kv in snap.items:
        parts = kv.key[len(store.keys.root) + 1 :].split("/")
        kind = "/".join(parts[:2]) if parts[0] == "meta" else parts[0]
        kinds[kind] += 1
        sizes[kind] += len(kv.key) + len(kv.value)
    status = store.client.status()
    return {
        "keys": len(snap.items),
        "bytes": sum(sizes.values()),
        "by_kind": {k: {"keys": kinds[k], "bytes": sizes[k]} for k in sorted(kinds)},
        "db_size_bytes": status.db_size,
    }


def sensor_ticks(settings: Settings, ticks: int) -> list[float]:
    import dagster as dg

    from vchan_assets.defs.cluster.datacoord import datacoord_sensor
    from vchan_assets.defs.resources import VchanEnvResource

    vchan_env = VchanEnvResource.from_settings(settings)
    seconds = []
    with dg.DagsterInstance.ephemeral() as instance:
        for _ in range(ticks):
            context = dg.build_sensor_context(instance=instance, resources={"vchan_env": vchan_env})
            started = time.perf_counter()
            datacoord_sensor(context)
            seconds.append(time.perf_counter() - started)
    return seconds


def assign_from_scratch(stepper: Stepper, store: MetaStore, live: set[int], channels: int) -> list[dict]:
    steps = []
    while True:
        report, seconds, requests = stepper.step()
        answered = answer(store, live)
        steps.append(
            {
                "seconds": seconds,
                "etcd_requests": requests,
                "assigned": len(report.assigned),
                "releasing": len(report.releasing),
                "removed": len(report.removed),
                "answered": answered,
            }
        )
        print(
            f"  step {len(steps)}: {seconds:.2f}s, {requests} etcd requests, assigned {len(report.assigned)}, "
            f"releasing {len(report.releasing)}",
            flush=True,
        )
        if not report.changed and len(watched(store, live)) == channels:
            return steps


def failover(
    stepper: Stepper, store: MetaStore, sessions: dict[int, Session], dead: list[int], ttl: float
) -> dict[str, Any]:
    owners = watched(store, set(sessions))
    victims = sorted(v for v, n in owners.items() if n in dead)
    live = set(sessions) - set(dead)
    session_keys = {store.keys.datanode_session(n) for n in dead}
    killed = time.monotonic()
    for node in dead:
        sessions[node].suspend_keepalive()
    gone_at = None
    steps: list[tuple[float, int]] = []
    while True:
        if gone_at is None and not any(store.get(k) for k in session_keys):
            gone_at = time.monotonic() - killed
        report, seconds, requests = stepper.step()
        if report.changed:
            steps.append((seconds, requests))
        answer(store, live)
        now = watched(store, live)
        if all(v in now for v in victims):
            rewatched = time.monotonic() - killed
            break
        if time.monotonic() - killed > ttl + 120:
            raise RuntimeError(f"{sum(v not in now for v in victims)} channels not re-watched")
        time.sleep(STEP_INTERVAL)
    return {
        "dead_nodes": len(dead),
        "channels_moved": len(victims),
        "session_gone_s": gone_at,
        "all_rewatched_s": rewatched,
        "target_s": ttl + 10,
        "changing_steps": len(steps),
        "slowest_step_s": max((s for s, _ in steps), default=0.0),
        "most_etcd_requests_in_a_step": max((r for _, r in steps), default=0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channels", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--dead", type=int, default=10)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--sensor-ticks", type=int, default=5)
    args = parser.parse_args()

    work, etcd, base = bench_stack("vchan-scale-")
    settings = replace(base, session_ttl=args.ttl, watch_timeout=60.0)
    store = MetaStore.connect(settings)
    sessions: dict[int, Session] = {}
    try:
        catalog = CollectionRegistry(store, IdAllocator(store))
        per = 4
        for i in range(args.channels // per):
            catalog.create(f"c{i}", SCHEMA, num_channels=per)
        for node in range(1, args.nodes + 1):
            info = NodeSession(node_id=node, address="simulated", version="sim", started_at=time.time())
            sessions[node] = Session.for_datanode(store, info, args.ttl).register()
        print(f"{args.channels} vchannels in {args.channels // per} collections, {args.nodes} node sessions")

        stepper = Stepper(store, settings, etcd.endpoint)
        started = time.perf_counter()
        steps = assign_from_scratch(stepper, store, set(sessions), args.channels)
        assign_seconds = time.perf_counter() - started
        steady = [stepper.step() for _ in range(5)]
        footprint = etcd_footprint(store)
        ticks = sensor_ticks(settings, args.sensor_ticks)
        dead = list(range(1, args.dead + 1))
        fail = failover(stepper, store, sessions, dead, args.ttl)
        results = {
            "channels": args.channels,
            "nodes": args.nodes,
            "ttl_s": args.ttl,
            "assignment": {"steps": steps, "seconds_total": assign_seconds},
            "steady_step": {
                "median_s": statistics.median(s for _, s, _ in steady),
                "median_etcd_requests": statistics.median(r for _, _, r in steady),
            },
            "etcd": footprint,
            "datacoord_sensor_tick_s": {"median": statistics.median(ticks), "max": max(ticks)},
            "failover": fail,
        }
    finally:
        for session in sessions.values():
            session.close()
        store.close()
        etcd.stop()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "assignment"}, indent=2))
    first = steps[0]
    print(
        f"assignment from scratch: {len(steps)} steps, {assign_seconds:.1f}s; first step {first['seconds']:.2f}s "
        f"with {first['etcd_requests']} etcd requests"
    )


if __name__ == "__main__":
    main()
