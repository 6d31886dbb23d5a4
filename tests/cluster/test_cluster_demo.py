"""`vchan demo --cluster`: the demo on a 3-member etcd, a Spark master with two workers,
an S3 server and PostgreSQL (the Dagster instance), all started by the command and all
stopped when it ends."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import pid_alive
from vchan_assets.testing.harness import VCHAN, cli_env


def test_demo_cluster_runs_the_demo_on_etcd_spark_workers_and_s3_then_stops_them(
    settings: Settings, tmp_path: Path
) -> None:
    env = {k: v for k, v in cli_env(settings).items() if not k.startswith(("VCHAN_", "AWS_"))}
    env.update(VCHAN_HOME=str(tmp_path / "home"), VCHAN_SPARK_DRIVER_MEMORY="512m", COLUMNS="160")
    done = subprocess.run(
        [str(VCHAN), "demo", "--cluster", "--rows", "2000", "--deletes", "20", "--channels", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    assert re.search(r"etcd 3\.\S+ at 127\.0\.0\.1:\d+,127\.0\.0\.1:\d+,127\.0\.0\.1:\d+", out), out
    assert re.search(r"\(spark://127\.0\.0\.1:\d+\), storage s3://vchan-demo/", out), out
    assert "after the lifecycle: 1,980 live rows, each once, every delete applied" in out
    assert "demo finished" in out and "cluster stopped" in out
    # The Dagster instance on PostgreSQL holds a checkpoint of each of the 2 vchannels.
    assert re.search(
        r"Dagster instance on PostgreSQL \(127\.0\.0\.1:\d+\): 2 channel checkpoints recorded", out
    ), out

    # Both workers started an executor for the demo's application.
    spark_home = tmp_path / "home" / "cluster-demo" / "spark"
    for worker in ("worker-0", "worker-1"):
        assert list((spark_home / worker).glob("app-*/*/stderr")), f"no executor ran on {worker}"
    # Every process of the table is gone.
    pids = [
        int(p)
        for p in re.findall(
            r"^│ (?:etcd member|Spark master|Spark worker|S3 server|PostgreSQL)[^│]*│ (\d+)", out, re.M
        )
    ]
    assert len(pids) == 3 + 1 + 2 + 1 + 1, out
    assert not [pid for pid in pids if pid_alive(pid)]
