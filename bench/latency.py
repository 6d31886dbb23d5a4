"""Per-change latency of the Dagster deployment: a 1,000-row change landing in the log ->
its channel checkpoint advanced past it, with the real daemon's sensors driving.

    .venv/bin/python -m bench.latency [--repeat 5] [--rows 1000]

Starts an embedded etcd, a local Spark Connect server, dagster-daemon and
dagster-webserver (a fresh DAGSTER_HOME with this repo's dagster.yaml) in a temporary
directory; creates a collection with one vchannel; waits until a Dagster-hosted
DataNode watches it; then, `repeat` times: insert `rows` rows (the change has landed
once `insert` returns) and poll etcd until the checkpoint offset reaches the change's
time tick. Reports each latency, the median and the max (target: <= 10 s).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.deploy.processes import wait_until
from vchan_assets.deploy.service import INSTANCE_CONFIG, DagsterService
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelLease, CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("id", {"embedding": 128}, {"age": "int64", "label": "string"})


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.latency")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vchan-latency-"))
    etcd = EmbeddedEtcd(tmp / "etcd").start()
    settings = replace(
        Settings(),
        home=tmp / "home",
        root=f"bench-{uuid.uuid4().hex[:6]}",
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(tmp / "storage"),
        sync_max_age=1.0,  # any unsynced row older than 1 s is synced
        session_ttl=10.0,
    )
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(INSTANCE_CONFIG, home / "dagster.yaml")
    service = DagsterService(settings, dagster_home=home, extra_env={"VCHAN_DAGSTER_DATANODES": "1"})
    store = MetaStore.connect(settings)
    try:
        t0 = time.monotonic()
        url = service.start()
        print(f"stack up in {time.monotonic() - t0:.1f}s; UI {url}", flush=True)
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        producer = Producer(System(settings, store, storage))
        info = producer.create_collection("latency", SCHEMA, [], num_channels=1)
        vchannel = info.vchannels[0]
        lease_key = store.keys.channel_lease(vchannel)
        watched = wait_until(lambda: store.get_model(lease_key, ChannelLease), 60, "the channel lease", 0.05)
        print(f"channel assigned after {watched:.1f}s", flush=True)
        latencies = []
        pk = 0
        for i in range(args.repeat + 1):
            positions = producer.insert(info.name, generate_rows(SCHEMA, args.rows, start_pk=pk, seed=i))
            landed = time.monotonic()
            pk += args.rows
            target = positions[vchannel].position.offset

            def committed(target: int = target) -> bool:
                cp = channel_checkpoint(store, vchannel)
                return cp is not None and cp.model.offset >= target

            wait_until(committed, 120, "the sync run's commit", 0.05)
            seconds = time.monotonic() - landed
            label = "warm-up (first sync of the channel)" if i == 0 else f"change {i}"
            print(f"{label}: {args.rows} rows committed {seconds:.2f}s after landing", flush=True)
            if i:
                latencies.append(seconds)
            time.sleep(1.0)
        print(
            f"latency over {args.repeat} changes of {args.rows} rows: median {statistics.median(latencies):.2f}s, "
            f"max {max(latencies):.2f}s (target <= 10 s)"
        )
    finally:
        store.close()
        service.stop()
        etcd.stop()


if __name__ == "__main__":
    main()
