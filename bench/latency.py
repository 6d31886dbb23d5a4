"""Per-change latency through Dagster against the standalone DataNode, in the same run: a
1,000-row change landing in the log -> its channel checkpoint advanced past it.

    .venv/bin/python -m bench.latency [--repeat 20] [--rows 1000] [--sync-loop 3600]

Starts an embedded etcd, a local Spark Connect server, dagster-daemon and
dagster-webserver (a fresh DAGSTER_HOME with this repo's dagster.yaml, one Dagster-hosted
DataNode) in a temporary directory, and a standalone `vchan datanode` process on the same
Spark Connect server. Collection `dagster` (one vchannel) goes to the Dagster-hosted node,
then collection `standalone` to the standalone node (the coordinator gives a new channel
to the node with the fewest). Then, `repeat` times and alternating between the two (so
the machine's noise hits both alike): insert `rows` rows (the change has landed once
`insert` returns) and poll etcd until the checkpoint offset reaches the change's time
tick. Reports the median and p95 of each (target through Dagster: <= 3 s median,
<= 5 s p95), and where the Dagster time went (`breakdown`): with sync runs
(`--sync-loop 0`, each sync a run of its own) the phases of each run from its event log;
with the sync loop, landing -> the loop's channel_checkpoints materialization.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg

from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.defs.sync.jobs import LOOP_JOB
from vchan_assets.deploy.processes import wait_until
from vchan_assets.deploy.service import INSTANCE_CONFIG, DagsterService
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelLease, CollectionInfo, CollectionSchema, NodeSession
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("id", {"embedding": 128}, {"age": "int64", "label": "string"})

# The phases of a sync run, as the event types that end them (breakdown of --sync-loop 0).
RUN_PHASES = (
    ("run created -> queued", "PIPELINE_ENQUEUED"),
    ("queued -> dequeued, launching", "PIPELINE_STARTING"),
    ("launch -> run process started", "ENGINE_EVENT"),
    ("process start -> run started (imports, definitions)", "PIPELINE_START"),
    ("run started -> step started (resources: Spark session)", "STEP_START"),
    ("step started -> checkpoint materialized (the sync)", "ASSET_MATERIALIZATION"),
)


def p95(values: list[float]) -> float:
    """The 95th percentile, linearly interpolated between the closest ranks (numpy's default)."""
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def summary(name: str, values: list[float]) -> str:
    return f"{name}: median {statistics.median(values):.2f}s, p95 {p95(values):.2f}s, max {max(values):.2f}s"


class Channel:
    """One collection of one vchannel, and the wait for a change to reach its checkpoint."""

    def __init__(
        self, producer: Producer, store: MetaStore, info: CollectionInfo, owned: Callable[[int | None], bool]
    ) -> None:
        self.producer, self.store, self.info, self.owned = producer, store, info, owned
        self.vchannel = info.vchannels[0]
        self.pk = 0
        self.latencies: list[float] = []
        self.landed: list[float] = []  # wall time of each change's landing

    def owner(self) -> int | None:
        found = self.store.get_model(self.store.keys.channel_lease(self.vchannel), ChannelLease)
        return found.model.node_id if found else None

    def change(self, rows: int, seed: int, keep: bool) -> float:
        positions = self.producer.insert(
            self.info.name, generate_rows(SCHEMA, rows, start_pk=self.pk, seed=seed)
        )
        landed, wall = time.monotonic(), time.time()
        self.pk += rows
        target = positions[self.vchannel].position.offset

        def committed() -> bool:
            cp = channel_checkpoint(self.store, self.vchannel)
            return cp is not None and cp.model.offset >= target

        wait_until(committed, 180, f"the commit of {self.info.name}'s change", 0.05)
        seconds = time.monotonic() - landed
        if not self.owned(self.owner()):
            # A node whose session expired (a starved daemon) lost the channel to the other
            # kind of node: what was measured is not what this bench compares.
            raise SystemExit(f"{self.info.name}'s channel moved to node {self.owner()}: measurement void")
        if keep:
            self.latencies.append(seconds)
            self.landed.append(wall)
        return seconds


def standalone_node(settings: Settings, spark_remote: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **replace(settings, spark_remote=spark_remote).to_env()}
    cmd = [str(Path(sys.executable).parent / "vchan"), "datanode", "--engine", "spark", "--address", "bench"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def standalone_ids(store: MetaStore) -> set[int]:
    found, _ = store.list_models(store.keys.datanode_session.prefix, NodeSession, skip_malformed=True)
    return {d.model.node_id for d in found if d.model.address == "bench"}


def breakdown(home: Path, landed: list[float]) -> list[str]:
    """Where the Dagster time went: the medians of each phase (see the module docstring)."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        loops = instance.get_runs_count(dg.RunsFilter(job_name=LOOP_JOB))
        if loops:
            return _loop_breakdown(instance, landed, loops)
        return _run_breakdown(instance, landed)


def _loop_breakdown(instance: dg.DagsterInstance, landed: list[float], loops: int) -> list[str]:
    stamps = sorted(
        r.timestamp
        for r in instance.fetch_materializations(dg.AssetKey("channel_checkpoints"), limit=10_000).records
    )
    delays = [min((s - t for s in stamps if s >= t), default=float("nan")) for t in landed]
    runs = instance.get_runs_count(dg.RunsFilter(job_name="sync"))
    return [
        f"sync loop: {loops} loop run(s), {runs} sync run(s) (watch/release), {len(stamps)} syncs reported",
        f"  landing -> channel_checkpoints materialization reported: median {statistics.median(delays):.2f}s",
    ]


def _run_breakdown(instance: dg.DagsterInstance, landed: list[float]) -> list[str]:
    phases: dict[str, list[float]] = {name: [] for name, _ in (("landing -> run created", ""), *RUN_PHASES)}
    for record in instance.get_run_records(dg.RunsFilter(job_name="sync")):
        created = record.create_timestamp.timestamp()
        before = [t for t in landed if t <= created]
        if not before or record.dagster_run.tags.get("vchan/reason") in ("watch", "release"):
            continue
        phases["landing -> run created"].append(created - max(before))
        at = created
        for name, event in RUN_PHASES:
            stamps = [e.timestamp for e in instance.all_logs(record.dagster_run.run_id) if _type(e) == event]
            if event == "ASSET_MATERIALIZATION":
                stamps = stamps[2:]  # binlogs, segments, then channel_checkpoints
            if stamps:
                phases[name].append(stamps[0] - at)
                at = stamps[0]
    return ["sync runs: medians per phase"] + [
        f"  {name}: {statistics.median(v):.2f}s" for name, v in phases.items() if v
    ]


def _type(entry: dg.EventLogEntry) -> str:
    return entry.dagster_event.event_type_value if entry.dagster_event else ""


def fresh_deployment(name: str, **overrides: Any) -> tuple[Path, EmbeddedEtcd, Settings, Path]:
    """A temporary directory, an embedded etcd in it, the settings of a stack there (any
    unsynced row older than 1 s is synced; `overrides`) and a fresh DAGSTER_HOME with this
    repo's dagster.yaml."""
    tmp = Path(tempfile.mkdtemp(prefix=f"vchan-{name}-"))
    etcd = EmbeddedEtcd(tmp / "etcd").start()
    settings = replace(
        Settings(),
        home=tmp / "home",
        root=f"{name}-{uuid.uuid4().hex[:6]}",
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(tmp / "storage"),
        sync_max_age=1.0,
        **overrides,
    )
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(INSTANCE_CONFIG, home / "dagster.yaml")
    return tmp, etcd, settings, home


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.latency")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument(
        "--sync-loop",
        type=float,
        default=Settings().dagster_sync_loop,
        help="VCHAN_DAGSTER_SYNC_LOOP (0: runs)",
    )
    args = parser.parse_args()
    # Sessions that outlive a starved daemon (a shared machine): a node whose session expires
    # loses its channel to the other node, and the run is void.
    tmp, etcd, settings, home = fresh_deployment(
        "latency", session_ttl=60.0, dagster_sync_loop=args.sync_loop
    )
    service = DagsterService(settings, dagster_home=home, extra_env={"VCHAN_DAGSTER_DATANODES": "1"})
    store = MetaStore.connect(settings)
    node: subprocess.Popen[bytes] | None = None
    try:
        t0 = time.monotonic()
        url = service.start()
        print(
            f"stack up in {time.monotonic() - t0:.1f}s; UI {url}; sync loop {args.sync_loop:g}s", flush=True
        )
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        producer = Producer(System(settings, store, storage))

        def create(name: str, owned: Callable[[int | None], bool]) -> Channel:
            info = producer.create_collection(name, SCHEMA, [], num_channels=1)
            channel = Channel(producer, store, info, owned)
            wait_until(lambda: owned(channel.owner()), 90, f"{name}'s channel lease", 0.05)
            return channel

        dagster = create("dagster", lambda owner: owner is not None and owner not in standalone_ids(store))
        spark_remote = json.loads(service.state_file.read_text())["spark_remote"]
        node = standalone_node(settings, spark_remote, tmp / "datanode.log")
        wait_until(lambda: standalone_ids(store), 60, "the standalone node's session", 0.1)
        standalone = create("standalone", lambda owner: owner in standalone_ids(store))
        print(f"channels: dagster node {dagster.owner()}, standalone node {standalone.owner()}", flush=True)
        for i in range(args.repeat + 1):
            for channel in (dagster, standalone):
                seconds = channel.change(args.rows, seed=i, keep=i > 0)
                label = "warm-up" if i == 0 else f"change {i}"
                print(
                    f"{channel.info.name} {label}: {args.rows} rows committed after {seconds:.2f}s",
                    flush=True,
                )
                time.sleep(1.0)
        print(summary("through Dagster", dagster.latencies) + " (target <= 3 s median, <= 5 s p95)")
        print(summary("standalone vchan datanode", standalone.latencies))
        for line in breakdown(home, dagster.landed):
            print(line)
    finally:
        if node is not None:
            node.terminate()
            node.wait(30)
        store.close()
        service.stop()
        etcd.stop()


if __name__ == "__main__":
    main()
