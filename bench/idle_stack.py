"""The CPU an idle `vchan up` stack takes: with Dagster's own daemon and with `vchan up`'s,
or with Dagster's SQLite storage and with `vchan up`'s.

    .venv/bin/python -m bench.idle_stack [--compare daemon|storage] [--rounds 2] [--settle 60]
        [--seconds 120] [--rows 2000]

`--compare daemon` (the default): Dagster's `dagster-daemon` starts a new code server every
minute. `vchan up` runs the daemon through `deploy/daemon.py`, which keeps its code server
while that server lives (docs/dagster-deploy.md).

`--compare storage`: both with `vchan up`'s daemon, the instance's `storage:` section once
Dagster's `sqlite` and once `vchan up`'s (`defs/instance_storage.py`: the same files, their
schema checked once per process instead of at every opening of the instance, which the code
server does for every sensor evaluation).

Each round starts the real deployment twice on a fresh DAGSTER_HOME, once per design, in
turn. A deployment here is the embedded etcd, one Spark
Connect server shared by both, the daemon, the webserver and two Dagster-hosted DataNodes.
Each start creates a collection of two vchannels and inserts `--rows` rows (2,000), then waits `settle`
seconds. Then, for `seconds` seconds, it sums the CPU of the deployment's processes: the
daemon, the webserver and all their descendants, the code servers and the run workers
included. It polls every 0.2 s, so a process that lives a second still counts. It also
counts the code servers started in that time.

The figure is the cores each design's deployment uses (CPU seconds / seconds), medians over
the rounds, and their ratio. The load average is recorded beside them.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench import bench_parser, write_report
from bench.latency import fresh_deployment
from vchan_assets.deploy.service import DagsterService
from vchan_assets.deploy.spark_connect import LocalSparkConnect
from vchan_assets.meta.embedded import read_record
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64"})
# name: (keep the code server, the instance's storage section: None is vchan up's)
Design = tuple[bool, Callable[[Path], dict[str, Any]] | None]
COMPARISONS: dict[str, dict[str, Design]] = {
    "daemon": {"dagster-daemon": (False, None), "vchan up's daemon": (True, None)},
    "storage": {
        "Dagster's SQLite storage": (True, lambda home: {"sqlite": {"base_dir": str(home)}}),
        "vchan up's SQLite storage": (True, None),
    },
}


def sample(roots: list[int], seconds: float) -> tuple[float, int, float]:
    """CPU seconds spent by `roots` and their descendants over `seconds` (polled every
    0.2 s), how many code servers started meanwhile, and the CPU seconds of the code
    servers (where sensors are evaluated)."""
    first: dict[tuple[int, float], float] = {}
    last: dict[tuple[int, float], float] = {}
    code_servers: set[tuple[int, float]] = set()
    started = time.time()
    while time.time() - started < seconds:
        for root in roots:
            try:
                tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
            except psutil.Error:
                continue
            for process in tree:
                try:
                    key = (process.pid, process.create_time())
                    times = process.cpu_times()
                    cpu = times.user + times.system
                    if key not in first:
                        first[key] = cpu if process.create_time() < started else 0.0
                        if "api grpc" in " ".join(process.cmdline()):
                            code_servers.add(key)
                    last[key] = cpu
                except psutil.Error:
                    continue
        time.sleep(0.2)
    in_servers = sum(last[k] - first[k] for k in code_servers)
    started_since = sum(1 for _, created in code_servers if created >= started)
    return sum(last[k] - first[k] for k in last), started_since, in_servers


def one(design: Design, spark_remote: str, rows: int, settle: float, seconds: float) -> dict[str, float]:
    keep, instance_storage = design
    tmp, etcd, settings, home = fresh_deployment("idle", session_ttl=60.0, spark_remote=spark_remote)
    section = instance_storage(home) if instance_storage else None
    service = DagsterService(settings, dagster_home=home, keep_code_server=keep, storage=section)
    store = MetaStore.connect(settings)
    try:
        service.start()
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        producer = Producer(System(settings, store, storage))
        info = producer.create_collection("idle", SCHEMA, [], num_channels=2)
        producer.insert(info.name, generate_rows(SCHEMA, rows, start_pk=1, seed=1))
        time.sleep(settle)
        roots = [int(p) for p in read_record(service.state_file)["pids"]]
        cpu, servers, in_servers = sample(roots, seconds)
        return {
            "cores": cpu / seconds,
            "code_server_cores": in_servers / seconds,
            "code_servers_started": servers,
            "load_average": os.getloadavg()[0],
        }
    finally:
        store.close()
        service.stop(stop_spark=False)
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = bench_parser(__doc__, 2_000, "bench/results/idle_stack.json")
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="daemon")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle", type=float, default=60.0)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    spark_dir = Path(tempfile.mkdtemp(prefix="vchan-idle-spark-"))
    spark = LocalSparkConnect(spark_dir)
    remote = spark.start()
    designs = COMPARISONS[args.compare]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in designs}
    try:
        for round_ in range(args.rounds):
            for name, design in designs.items():
                result = one(design, remote, args.rows, args.settle, args.seconds)
                runs[name].append(result)
                print(
                    f"round {round_ + 1} {name}: {result['cores']:.2f} cores "
                    f"(code servers {result['code_server_cores']:.2f}), "
                    f"{result['code_servers_started']} code servers started, load {result['load_average']:.1f}",
                    flush=True,
                )
    finally:
        spark.stop()
        shutil.rmtree(spark_dir, ignore_errors=True)
    medians = {name: statistics.median(r["cores"] for r in rs) for name, rs in runs.items()}
    in_servers = {name: statistics.median(r["code_server_cores"] for r in rs) for name, rs in runs.items()}
    (stock, stock_cores), (ours, our_cores) = medians.items()
    report: dict[str, Any] = {
        "compare": args.compare,
        "settle_s": args.settle,
        "seconds": args.seconds,
        "runs": runs,
        "median_cores": medians,
        "median_code_server_cores": in_servers,
        "ratio": our_cores / stock_cores,
    }
    print(f"median cores: {stock} {stock_cores:.2f}, {ours} {our_cores:.2f} (ratio {report['ratio']:.2f})")
    print(f"of which the code servers: {stock} {in_servers[stock]:.2f}, {ours} {in_servers[ours]:.2f}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
