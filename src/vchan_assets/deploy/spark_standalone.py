"""A Spark standalone cluster on loopback: one master and N workers from the installed
pyspark (`bin/spark-class org.apache.spark.deploy.master.Master` / `...worker.Worker`).

Each worker offers a small, fixed share of the machine (`cores`, `memory`); executors
are JVMs the workers start for an application, and the sync's `mapInArrow` tasks run
in those executors' Python workers (this interpreter: PYSPARK_PYTHON). The master's
and workers' JSON status pages (`/json/` on their web UI ports) say which workers are
alive and which executors run where.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vchan_assets.deploy.processes import ServiceError, kill_tree, spawn, stop_tree
from vchan_assets.meta.embedded import free_port, pid_alive

log = logging.getLogger(__name__)

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


class SparkClusterError(ServiceError):
    """The standalone master or a worker did not start."""


def pyspark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def json_page(port: int, timeout: float = 2.0) -> dict[str, Any]:
    """The JSON status page of a master or worker web UI on loopback."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/", timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


@dataclass
class SparkWorker:
    index: int
    ui_port: int
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class SparkStandalone:
    """Master + `workers` workers under `home` (logs, work dirs)."""

    home: Path
    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    daemon_memory: str = "256m"  # heap of the master and worker daemons themselves
    detach: bool = False
    port: int = 0
    ui_port: int = 0
    master: subprocess.Popen[bytes] | None = None
    started: list[SparkWorker] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_SUBMIT"))}
        env.update(
            SPARK_HOME=str(pyspark_home()),
            SPARK_DAEMON_MEMORY=self.daemon_memory,
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_LOG_DIR=str(self.home / "logs"),
            PYSPARK_PYTHON=sys.executable,
        )
        env.update(extra or {})
        return env

    def _spark_class(self, *args: str) -> list[str]:
        return [str(pyspark_home() / "bin" / "spark-class"), *args]

    def start(self, timeout: float = 90.0, worker_env: dict[int, dict[str, str]] | None = None) -> str:
        """Start the master and the workers; returns the master URL once every worker is
        registered. `worker_env` adds environment variables to some workers (index ->
        variables), which their executors and Python workers inherit."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.port, self.ui_port = free_port(), free_port()
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port)]
        self.master = spawn(
            self._spark_class(MASTER_CLASS, *args), self.home / "master.log", self._env(), self.detach
        )
        for index in range(self.workers):
            self.add_worker((worker_env or {}).get(index))
        self.wait_workers(self.workers, timeout)
        log.info("Spark standalone master %s with %d workers", self.url, self.workers)
        return self.url

    def add_worker(self, env: dict[str, str] | None = None) -> SparkWorker:
        index = len(self.started)
        ui_port = free_port()
        work = self.home / f"worker-{index}"
        args = ["--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory]
        args += ["--webui-port", str(ui_port), "--work-dir", str(work), self.url]
        process = spawn(
            self._spark_class(WORKER_CLASS, *args),
            self.home / f"worker-{index}.log",
            self._env(env),
            self.detach,
        )
        worker = SparkWorker(index, ui_port, process)
        self.started.append(worker)
        return worker

    def status(self) -> dict[str, Any]:
        """The master's JSON status (workers, active and completed applications)."""
        return json_page(self.ui_port)

    def alive_workers(self) -> int:
        try:
            return sum(1 for w in self.status()["workers"] if w["state"] == "ALIVE")
        except (OSError, ValueError, KeyError):
            return 0

    def wait_workers(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_workers() < count:
            if self.master is not None and self.master.poll() is not None:
                raise SparkClusterError(f"Spark master exited; see {self.home / 'master.log'}")
            if time.monotonic() > deadline:
                raise SparkClusterError(
                    f"{count} Spark workers not registered within {timeout:.0f}s; see {self.home}/worker-*.log"
                )
            time.sleep(0.3)

    def kill_worker(self, index: int) -> list[int]:
        """SIGKILL a worker with its executors and their Python workers (a dead machine)."""
        worker = self.started[index]
        victims = kill_tree(worker.pid)
        worker.process.wait(10)
        return victims

    def stop(self) -> None:
        for worker in self.started:
            if pid_alive(worker.pid):
                stop_tree(worker.pid)
        if self.master is not None and pid_alive(self.master.pid):
            stop_tree(self.master.pid)
