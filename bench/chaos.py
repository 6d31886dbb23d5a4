"""Chaos soak: the chaos test's seeded fault schedule against real processes for N minutes.

    .venv/bin/python -m bench.chaos --minutes 30 [--seed 20261123] [--gap 1 4] [--rows 40] [--period 0.2]

An embedded etcd, one collection with 4 vchannels, 3 `vchan datanode --engine local` and 2
`vchan datacoord` processes (real OS processes, session TTL 2 s), and a producer writing
`--rows` rows and 2 deletes every `--period` seconds. For `--minutes`, one fault after
another, `--gap` seconds apart (uniform between the two; 1-4 s as in the test), picked at
random by `--seed` (`harness.ChaosSchedule`, the schedule of tests/datacoord/test_chaos.py:
the same seed gives the same faults and victims): kill -9 of a node, kill -9 of a
coordinator, SIGSTOP of a node past its TTL (then SIGCONT), kill -9 and restart of etcd
(the producer waits between batches while etcd is down, so that no insert ends in doubt).
Dead roles are replaced before each fault. etcd gets `--etcd-timeout` seconds to come
back; `--etcd-snapshot-count` bounds the WAL it replays on the way (etcd takes no
snapshot before 100,000 entries by default, and a restart replays all of them).

Then the producer stops, a time tick is appended, and the soak measures the time from the
end of the last fault until every channel's checkpoint is at its log's head (target: TTL
+ 10 s), and reads the live segments' binlogs and delta logs back with pyarrow
(`harness.exactly_once`): rows and deletes lost, persisted more than once or never
produced, and columns whose values differ from what was produced (target: none, over
>= 300 faults in 30 minutes).

Prints a summary and a BENCHMARKS.md table row, writes bench/results/chaos.json; exits 1
if anything was lost or duplicated or a channel did not catch up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import bench_stack
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.testing.harness import (
    FAULTS,
    ChaosSchedule,
    Cluster,
    PausableLoad,
    all_synced,
    create_collections,
    exactly_once,
    fast_settings,
    owners,
    wait_until,
)

RESULTS = Path(__file__).with_name("results") / "chaos.json"
SEED = 20261123
CATCH_UP_LIMIT = 600.0  # seconds after the last fault before a channel counts as stuck


def soak(
    minutes: float,
    seed: int,
    gap: tuple[float, float],
    rows: int,
    period: float,
    keep: bool,
    snapshot_count: int | None,
    etcd_timeout: float,
) -> dict[str, Any]:
    work, etcd, settings = bench_stack("vchan-chaos-", snapshot_count=snapshot_count)
    settings = fast_settings(settings)
    cluster = Cluster(settings, work)
    store = MetaStore.connect(settings)
    loads: list[float] = []
    report: dict[str, Any] = {
        "minutes": minutes,
        "seed": seed,
        "gap_s": list(gap),
        "etcd_snapshot_count": snapshot_count,
        "etcd_timeout_s": etcd_timeout,
        "rows_per_batch": rows,
        "period_s": period,
    }
    ok = False
    try:
        producer, infos = create_collections(store, settings, count=1, shards=4)
        info = infos[0]
        load = PausableLoad(producer, info, rows=rows, period=period)
        chaos = ChaosSchedule(
            cluster, etcd, load, seed, nodes=3, coordinators=2, gap=gap, etcd_timeout=etcd_timeout
        )
        chaos.replenish(nodes=3, coordinators=2)
        wait_until(lambda: owners(store, list(info.vchannels)), 60, "every channel watched")
        load.start()
        started = time.monotonic()
        next_report = started + 60

        def progress(fault: str) -> None:
            nonlocal next_report
            loads.append(os.getloadavg()[0])
            if time.monotonic() >= next_report:
                next_report += 60
                print(
                    f"  {(time.monotonic() - started) / 60:.1f} min: {len(chaos.survived)} faults "
                    f"{dict(Counter(chaos.survived))}, {load.produced.row_count} rows produced, "
                    f"load {loads[-1]:.1f}",
                    flush=True,
                )

        try:
            chaos.run(minutes * 60, on_fault=progress)
        except Exception as exc:  # a role that would not start, etcd that did not come back
            report["stopped_early"] = f"{type(exc).__name__}: {exc}"
            print(f"  faults stopped early after {len(chaos.survived)}: {exc}", flush=True)
        report["chaos_s"] = round(time.monotonic() - started, 1)
        chaos.replenish(nodes=2, coordinators=1)
        load.stop()
        producer.time_tick(info.name)
        storage = Storage.from_settings(settings)
        last = chaos.last_fault_end if chaos.last_fault_end is not None else started
        try:
            wait_until(lambda: all_synced(store, storage, infos), CATCH_UP_LIMIT, "every channel caught up")
            caught_up: float | None = round(time.monotonic() - last, 2)
        except TimeoutError:
            caught_up = None
        print("  reading the live segments back ...", flush=True)
        tally = exactly_once(store, storage, info, load.produced)
        target = settings.session_ttl + 10
        report.update(
            faults=dict(Counter(chaos.survived)),
            faults_total=len(chaos.survived),
            rows=tally.rows,
            deletes=tally.deletes,
            lost=len(tally.lost),
            duplicated=len(tally.duplicated),
            never_produced=len(tally.unexpected),
            differing_columns=tally.differing,
            deletes_lost=len(tally.deletes_lost),
            deletes_duplicated=len(tally.deletes_duplicated),
            deletes_never_produced=len(tally.deletes_unexpected),
            tally=tally.describe(),
            exactly_once=tally.ok,
            ttl_s=settings.session_ttl,
            caught_up_after_last_fault_s=caught_up,
            catch_up_target_s=target,
            catch_up_met=caught_up is not None and caught_up <= target,
            load_avg_1m={
                "start": round(loads[0], 2) if loads else None,
                "mean": round(sum(loads) / len(loads), 2) if loads else None,
                "max": round(max(loads), 2) if loads else None,
            },
            roles_started=len(cluster.roles),
            etcd_restart_s={
                "median": round(statistics.median(chaos.etcd_restarts), 2) if chaos.etcd_restarts else None,
                "max": round(max(chaos.etcd_restarts), 2) if chaos.etcd_restarts else None,
            },
        )
        ok = tally.ok and caught_up is not None
    finally:
        cluster.cleanup()
        store.close()
        etcd.stop()
        if ok and not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            report["work"] = str(work)
    return report


def caught_up(seconds: float | None) -> str:
    return f"not within {CATCH_UP_LIMIT:g} s" if seconds is None else f"{seconds:.1f} s"


def table_row(report: dict[str, Any], date: str) -> str:
    faults = report["faults"]
    return (
        f"| {date} | {report['chaos_s'] / 60:.1f} | {report['seed']} | "
        f"{report['gap_s'][0]:g}-{report['gap_s'][1]:g} s | "
        + " | ".join(str(faults.get(kind, 0)) for kind in FAULTS)
        + f" | **{report['faults_total']}** | {report['rows']:,} | {report['deletes']:,} | "
        f"{report['lost']} | {report['duplicated']} | "
        f"{caught_up(report['caught_up_after_last_fault_s'])} "
        f"(target {report['catch_up_target_s']:g} s) | {report['load_avg_1m']['mean']} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="how long faults go on")
    parser.add_argument("--seed", type=int, default=SEED, help="picks the schedule")
    parser.add_argument(
        "--gap",
        type=float,
        nargs=2,
        default=(1.0, 4.0),
        metavar=("LOW", "HIGH"),
        help="seconds between faults",
    )
    parser.add_argument(
        "--etcd-snapshot-count",
        type=int,
        default=None,
        help="etcd's --snapshot-count (default: etcd's, 100,000): WAL entries replayed at a restart at most",
    )
    parser.add_argument("--etcd-timeout", type=float, default=120.0, help="seconds etcd has to come back")
    parser.add_argument("--rows", type=int, default=40, help="rows per producer batch (2 of them deleted)")
    parser.add_argument("--period", type=float, default=0.2, help="seconds between producer batches")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (etcd, storage, logs)")
    args = parser.parse_args(argv)
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"chaos soak: {args.minutes:g} min, seed {args.seed}, faults {args.gap[0]:g}-{args.gap[1]:g} s apart, "
        f"started {date}",
        flush=True,
    )
    report = soak(
        args.minutes,
        args.seed,
        tuple(args.gap),
        args.rows,
        args.period,
        args.keep,
        args.etcd_snapshot_count,
        args.etcd_timeout,
    )
    report["date"] = date
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    caught = report["caught_up_after_last_fault_s"]
    print(
        f"faults survived: {report['faults_total']} {report['faults']} in {report['chaos_s'] / 60:.1f} min "
        f"(target >= 300 in 30 min)"
    )
    print(f"exactly once: {report['exactly_once']}: {report['tally']}")
    print(
        f"every channel caught up: {caught_up(caught)} "
        f"after the last fault (target TTL + 10 = {report['catch_up_target_s']:g}s: "
        f"{'met' if report['catch_up_met'] else 'MISSED'})"
    )
    print(f"load average (1 min) during the faults: {report['load_avg_1m']}")
    print(f"etcd kill -9 -> healthy again: {report['etcd_restart_s']}")
    if "work" in report:
        print(f"work directory kept: {report['work']}")
    print(f"wrote {RESULTS}")
    print(
        "| date | minutes | seed | gap | "
        + " | ".join(FAULTS)
        + " | total | rows | deletes | lost | duplicated |"
        " caught up after last fault | load avg |"
    )
    print(table_row(report, date))
    if not (report["exactly_once"] and caught is not None):
        sys.exit(1)


if __name__ == "__main__":
    main()
