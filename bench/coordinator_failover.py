"""Kill -9 of the active DataCoord mid-sort and mid-build, a standby running: how long until
every flushed segment is sorted (visible) and indexed again.

    .venv/bin/python -m bench.coordinator_failover [--rows 2000000] [--segments 5] [--ttl 10]

Two `vchan datacoord --engine local` processes on a real etcd: the first active, the
second its standby. For each phase a new collection (2 vchannels, an HNSW index on its
vector field) is filled with `--rows` rows in `--segments` rounds of insert, flush and
sync; the active DataCoord sorts and indexes them and is SIGKILLed by its failpoint:

- mid-sort: `compaction_after_files=kill` (a sort plan Executing, its output files
  written, nothing committed);
- mid-build: `index_after_files=kill` (an index build Running, its file written, not
  Finished).

Measured from the kill (the failpoint's marker, written just before it) until every live
segment is sorted and visible, and until each has a Finished build, beside 2 x the session
TTL (how long the standby may wait for the dead term's session to expire). The target
is 2 x TTL + the sort's (or the builds') own time: the own times are in the standby's log
(`compaction ... (sort)` and `index build ... in N s` lines) and are said with the figures in
BENCHMARKS.md. Before plans recorded their worker, the standby waited for
VCHAN_COMPACTION_TIMEOUT (checked at the 300-s lifecycle step): 741 s after a kill mid-sort
of 2M rows, 3 of 5 segments still invisible.

Results: bench/results/coordinator_failover.json (or `--out`).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import bench_system, wait_for, write_report
from vchan_assets.indexes.meta import create_index, indexable, list_builds
from vchan_assets.model import CollectionInfo, SegmentIndexState
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, VCHAN, Produced, cli_env, produce
from vchan_assets.testing.steps import live_l1, sync_all
from vchan_assets.wal.producer import Producer

PHASES = {"mid-sort": "compaction_after_files", "mid-build": "index_after_files"}


def visible(system: System, info: CollectionInfo) -> bool:
    live = live_l1(system.store, info)
    return bool(live) and all(s.is_sorted and not s.is_invisible for s in live)


def indexed(system: System, info: CollectionInfo) -> bool:
    live = [s for s in live_l1(system.store, info) if indexable(s)]
    done = {
        b.model.segment_id
        for b in list_builds(system.store, info.id)
        if b.model.state is SegmentIndexState.FINISHED
    }
    return visible(system, info) and all(s.id in done for s in live)


def own_times(log: Path) -> dict[str, Any]:
    """What the standby's own work took, from its log: its sorts and its index builds."""
    text = log.read_text(errors="replace")
    builds = [float(s) for s in re.findall(r"index build \d+ \(.*? in ([0-9.]+)s", text)]
    return {
        "standby_sorts": len(re.findall(r"compaction \d+ \(sort\): ", text)),
        "standby_mixes": len(re.findall(r"compaction \d+ \(mix\): ", text)),
        "standby_builds": len(builds),
        "standby_build_s_max": round(max(builds, default=0.0), 1),
        "standby_build_s_sum": round(sum(builds), 1),
    }


def phase(system: System, name: str, point: str, rows: int, rounds: int, timeout: float) -> dict[str, Any]:
    """One kill of the active DataCoord at `point`, a standby running; the times."""
    producer = Producer(system)
    info = producer.create_collection(f"f{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    create_index(system.store, info, "vec", "HNSW", "L2", {"M": 16, "efConstruction": 100})
    marker = system.settings.home / f"{name}.failpoint"
    env = cli_env(system.settings, VCHAN_FAILPOINT=f"{point}=kill", VCHAN_FAILPOINT_MARKER=str(marker))
    logs = system.settings.home
    with open(logs / f"{name}-first.log", "wb") as out:
        first = subprocess.Popen([str(VCHAN), "datacoord", "--engine", "local"], env=env, stderr=out)
    wait_for(
        lambda: system.store.get(system.store.keys.datacoord_session()) is not None,
        120,
        "an active DataCoord",
    )
    standby_env = {k: v for k, v in env.items() if not k.startswith("VCHAN_FAILPOINT")}
    with open(logs / f"{name}-standby.log", "wb") as out:
        standby = subprocess.Popen(
            [str(VCHAN), "datacoord", "--engine", "local"], env=standby_env, stderr=out
        )
    try:
        produced = Produced()
        per = rows // rounds
        first_flush = None
        for r in range(rounds):
            produce(producer, info.name, produced, per, start_pk=r * per, deletes=0)
            producer.flush(info.name)
            sync_all(system, info)
            first_flush = first_flush or time.time()
            print(f"  {name}: {(r + 1) * per:,} rows flushed", flush=True)
        wait_for(lambda: first.poll() is not None, timeout, f"the first DataCoord killed at {point}", 0.05)
        assert first.returncode == -signal.SIGKILL, first.returncode
        assert first_flush is not None
        killed = marker.stat().st_mtime  # written by the failpoint just before the kill
        wait_for(lambda: visible(system, info), timeout, "every segment sorted and visible", 0.25)
        to_visible = time.time() - killed
        wait_for(lambda: indexed(system, info), timeout, "every segment indexed", 0.25)
        to_indexed = time.time() - killed
        ttl = system.settings.session_ttl
        own = killed - first_flush
        result = {
            "phase": name,
            "failpoint": point,
            "rows": rows,
            "segments": len(live_l1(system.store, info)),
            "first_flush_to_kill_s": round(own, 1),
            "kill_to_visible_s": round(to_visible, 1),
            "kill_to_indexed_s": round(to_indexed, 1),
            "two_ttl_s": round(2 * ttl, 1),
            "load_1m": round(os.getloadavg()[0], 1),
            **own_times(logs / f"{name}-standby.log"),
        }
        print(f"  {result}", flush=True)
        return result
    finally:
        for proc in (first, standby):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--segments", type=int, default=5, help="rounds of insert, flush and sync")
    parser.add_argument("--ttl", type=float, default=10.0, help="VCHAN_SESSION_TTL of both DataCoords")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default="bench/results/coordinator_failover.json")
    args = parser.parse_args()
    with bench_system("vchan-coord-failover-") as (_, system):
        system = replace(system, settings=replace(system.settings, session_ttl=args.ttl))
        runs = [
            phase(system, name, point, args.rows, args.segments, args.timeout)
            for name, point in PHASES.items()
        ]
    write_report(
        args.out,
        {
            "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
            "session_ttl_s": args.ttl,
            "old_kill_to_visible_s": "741 s, 3 of 5 segments still invisible (2M rows, before plans named their worker)",
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
