"""Dagster instance storage under a steady sync load, extrapolated per day
(docs/dagster.md).

    .venv/bin/python -m bench.dagster_soak [--minutes 30] [--channels 4] [--sync-loop 3600]

Starts the real stack (embedded etcd, Spark Connect, dagster-daemon and webserver on a
fresh DAGSTER_HOME with this repo's dagster.yaml, two Dagster-hosted DataNodes), creates
one collection of `channels` vchannels and inserts 200 rows into it every second for
`minutes` minutes (VCHAN_SYNC_MAX_AGE=1: every channel syncs as often as the stack lets
it, far more often than the production rate of one sync per 30 s). Then it measures the
instance: bytes on disk under DAGSTER_HOME (runs, event logs, the asset index, sensor
ticks), runs, event log entries and sensor ticks, and the syncs done (checkpoints
reported). The per-day figure for production is bytes per sync x 2,880 syncs a day per
channel x 100 channels, plus the ticks' bytes per day (ticks come at a fixed rate,
whatever the load); bounded by the retention (VCHAN_DAGSTER_RETENTION_DAYS, sensor ticks
by dagster.yaml), it is that per-day figure x the retention's days.

`--sync-loop 0` is the design before the sync loop (every sync a run); the default is the sync
loop of each node (docs/dagster.md).
"""

import argparse
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg

from bench.latency import fresh_deployment
from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.defs.checks import reported_events, typed
from vchan_assets.defs.partitions import VCHANNELS, vchannels
from vchan_assets.defs.sync.assets import BINLOGS, CHANNEL_CHECKPOINTS, SEGMENTS, SYNC_CHECKS
from vchan_assets.defs.sync.jobs import LOOP_JOB
from vchan_assets.deploy.service import INSTANCE_CONFIG, DagsterService
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("id", {"embedding": 128}, {"age": "int64"})
SYNCS_PER_DAY = 100 * 86400 // 30  # 100 channels, one sync each per 30 s
MB = 1024 * 1024


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def count_materializations(instance: dg.DagsterInstance, key: dg.AssetKey) -> int:
    count, cursor = 0, None
    while True:
        page = instance.fetch_materializations(key, limit=10_000, cursor=cursor)
        count += len(page.records)
        if not page.has_more:
            return count
        cursor = page.cursor


def measure(home: Path) -> dict[str, Any]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        syncs = count_materializations(instance, dg.AssetKey("channel_checkpoints"))
        runs = instance.get_runs_count()
        loops = instance.get_runs_count(dg.RunsFilter(job_name=LOOP_JOB))
        jobs: Counter[str] = Counter()
        events_by_job: Counter[str] = Counter()
        for r in instance.get_run_records(limit=100_000):
            jobs[r.dagster_run.job_name] += 1
            events_by_job[r.dagster_run.job_name] += len(instance.all_logs(r.dagster_run.run_id))
        events = sum(events_by_job.values())
        ticks = sum(
            len(instance.get_ticks(s.instigator_origin_id, s.selector_id, limit=1_000_000))
            for s in instance.all_instigator_state()
        )
    ticks_bytes = du(home / "schedules") if (home / "schedules").exists() else 0
    return {
        "bytes": du(home),
        "ticks_bytes": ticks_bytes,
        "syncs": syncs,
        "runs": runs,
        "loop_runs": loops,
        "events": events,
        "ticks": ticks,
        "jobs": dict(jobs.most_common()),
        "events_by_job": dict(events_by_job.most_common()),
    }


# What one sync reports, as the sync run and the loop record it (defs/sync/assets.py): the
# same keys, typed values of the same size.
COMMON: dict[str, Any] = {
    "position_range": "(120345, 121346]",
    "start_offset": 120345,
    "end_offset": 121346,
    "lease_id": 4321,
}
COMMON |= {"node_id": 1001, "reason": "buffer 16.0 MB >= 16 MB"}
BINLOGS_META: dict[str, Any] = {
    "rows": 4000,
    "deletes": 12,
    "files": 6,
    "bytes": 16_777_216,
    "seconds": 1.234,
}
BINLOGS_META |= {"seconds_state": 0.012, "seconds_binlogs": 1.1, "seconds_commit": 0.12}
BINLOGS_META |= {"written_by": "Spark job", "skipped": ""}
SEGMENTS_META: dict[str, Any] = {
    "segments_touched": 1,
    "segments_flushed": 0,
    "segments_total": 37,
    "rows": 148_000,
}
SEGMENTS_META |= {"deletes": 310}
CHECKPOINT_META: dict[str, Any] = {"checkpoint_offset": 121346, "checkpoint_ts": 454_021_134_217_728_001}
CHECKPOINT_META |= {"previous_checkpoint_offset": 120345, "checkpoint_lag_messages": 0}
CHECKPOINT_META |= {"checkpoint_lag_seconds": 0.812}
CHECK_TEXT = "committed range [0, 121346]: insert binlogs 148000 / log inserts 148000, lost rows 0"


def one_sync() -> list[dg.MaterializeResult | dg.AssetCheckResult]:
    """The three materializations and four check results of one sync."""
    metas = (BINLOGS_META, SEGMENTS_META, CHECKPOINT_META)
    return [
        *(
            dg.MaterializeResult(asset_key=spec.key, metadata=typed({**COMMON, **meta}))
            for spec, meta in zip((BINLOGS, SEGMENTS, CHANNEL_CHECKPOINTS), metas, strict=True)
        ),
        *(
            dg.AssetCheckResult(
                check_name=c.name,
                asset_key=c.asset_key,
                passed=True,
                description=CHECK_TEXT,
                metadata={"n": 148_000},
            )
            for c in SYNC_CHECKS
        ),
    ]


@dg.multi_asset(
    name="sync_vchannel",
    specs=[BINLOGS, SEGMENTS, CHANNEL_CHECKPOINTS],
    check_specs=list(SYNC_CHECKS),
    partitions_def=vchannels,
)
def recorded_sync() -> Iterator[dg.MaterializeResult | dg.AssetCheckResult]:
    """A sync run's events without the sync (the storage model)."""
    yield from one_sync()


class LoopSyncs(dg.Config):
    syncs: int
    channels: int


@dg.op(out={})
def recorded_loop(config: LoopSyncs) -> Iterator[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
    """A sync loop run's events for `syncs` syncs, round robin over the channels."""
    for i in range(config.syncs):
        yield from reported_events(one_sync(), f"ch{i % config.channels}")


@dg.job
def recorded_loop_job() -> None:
    recorded_loop()


def storage_model(syncs: int, channels: int, loop_syncs: int) -> None:
    """Bytes per sync in a SQLite instance (this repo's dagster.yaml), each design writing
    what it writes per sync, without the daemon, Spark or etcd: `syncs` runs of the sync
    multi-asset (one run per sync), then loop runs of `loop_syncs` syncs each."""
    for mode in ("runs", "loop"):
        home = Path(tempfile.mkdtemp(prefix=f"vchan-storage-{mode}-"))
        shutil.copy(INSTANCE_CONFIG, home / "dagster.yaml")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            instance.add_dynamic_partitions(VCHANNELS, [f"ch{i}" for i in range(channels)])
            base = du(home)
            t0 = time.monotonic()
            if mode == "runs":
                for i in range(syncs):
                    dg.materialize([recorded_sync], instance=instance, partition_key=f"ch{i % channels}")
            else:
                for _ in range(max(1, syncs // loop_syncs)):
                    config = {
                        "ops": {"recorded_loop": {"config": {"syncs": loop_syncs, "channels": channels}}}
                    }
                    recorded_loop_job.execute_in_process(run_config=config, instance=instance)
            seconds = time.monotonic() - t0
            done = count_materializations(instance, CHANNEL_CHECKPOINTS.key)
            runs = instance.get_runs_count()
            events = sum(len(instance.all_logs(r.run_id)) for r in instance.get_runs())
        per_sync = (du(home) - base) / done
        per_day = per_sync * SYNCS_PER_DAY
        print(
            f"{mode}: {done} syncs in {runs} runs ({seconds:.0f}s), {events} events "
            f"({events / done:.1f} per sync), {per_sync / 1024:.2f} KB per sync -> "
            f"{per_day / MB / 1024:.2f} GB/day at {SYNCS_PER_DAY:,} syncs/day, "
            f"{'one run per sync' if mode == 'runs' else f'{int(2 * 86400 / 3600)} loop runs'}/day",
            flush=True,
        )
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.dagster_soak")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--sync-loop", type=float, default=Settings().dagster_sync_loop)
    parser.add_argument("--retention-days", type=float, default=Settings().dagster_retention_days)
    parser.add_argument(
        "--storage-model",
        type=int,
        default=0,
        metavar="SYNCS",
        help="no stack: record SYNCS syncs as each design does (runs, loop) and report the bytes per sync",
    )
    args = parser.parse_args()
    if args.storage_model:
        storage_model(args.storage_model, args.channels, loop_syncs=min(args.storage_model, 1000))
        return
    tmp, etcd, settings, home = fresh_deployment("soak", dagster_sync_loop=args.sync_loop)
    service = DagsterService(settings, dagster_home=home)
    store = MetaStore.connect(settings)
    stop = threading.Event()
    try:
        service.start()
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        system = System(settings, store, storage)
        producer = Producer(system)
        info = producer.create_collection("soak", SCHEMA, [], num_channels=args.channels)
        base = du(home)

        def produce() -> None:
            pk = 0
            while not stop.wait(1.0):
                producer.insert(info.name, generate_rows(SCHEMA, 200, start_pk=pk, seed=pk))
                pk += 200

        load = threading.Thread(target=produce, daemon=True)
        start = time.monotonic()
        load.start()
        last = 0
        print(
            f"soak: {args.channels} channels, sync loop {args.sync_loop:g}s, {args.minutes:g} min", flush=True
        )
        while (elapsed := time.monotonic() - start) < args.minutes * 60:
            time.sleep(min(60.0, args.minutes * 60 - elapsed))
            synced = sum(cp.model.offset for v in info.vchannels if (cp := channel_checkpoint(store, v)))
            print(
                f"  {elapsed / 60:.1f} min: instance {du(home) / MB:.1f} MB, checkpoints at {synced:,} "
                f"(+{synced - last:,} messages)",
                flush=True,
            )
            last = synced
        stop.set()
        load.join(10)
        minutes = (time.monotonic() - start) / 60
        kinds = Counter(
            (s.state.value, s.level.value, "sorted" if s.is_sorted else "unsorted")
            for s in Catalog(system).segment_infos()
        )
        print(f"segments by state, level, sort: {dict(kinds.most_common())}", flush=True)
    finally:
        stop.set()
        store.close()
        service.stop()
        etcd.stop()
    m = measure(home)
    grown = m["bytes"] - base
    ticks_per_day = m["ticks_bytes"] * 1440 / minutes
    per_sync = (grown - m["ticks_bytes"]) / max(1, m["syncs"])
    per_day = per_sync * SYNCS_PER_DAY + ticks_per_day
    print(
        f"after {minutes:.1f} min: instance {m['bytes'] / MB:.1f} MB (+{grown / MB:.1f} MB), "
        f"{int(m['syncs'])} syncs reported, {int(m['runs'])} runs ({int(m['loop_runs'])} loop runs), "
        f"{int(m['events'])} run events, {int(m['ticks'])} sensor ticks ({m['ticks_bytes'] / MB:.1f} MB)"
    )
    print(
        f"per sync {per_sync / 1024:.1f} KB (+ {m['events'] / max(1, m['syncs']):.1f} run events); "
        f"ticks {ticks_per_day / MB:.1f} MB/day"
    )
    print(f"runs by job: {m['jobs']}; run events by job: {m['events_by_job']}")
    print(
        f"production (100 channels, a sync per 30 s each: {SYNCS_PER_DAY:,} syncs/day): "
        f"{per_day / MB / 1024:.2f} GB/day; runs/day "
        f"{SYNCS_PER_DAY if not args.sync_loop else int(2 * 86400 / args.sync_loop)} (+ watch/release); "
        f"bounded at {args.retention_days:g} days' retention: {per_day * args.retention_days / MB / 1024:.1f} GB"
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
