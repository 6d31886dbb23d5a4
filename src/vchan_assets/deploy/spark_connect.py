"""A long-lived local Spark Connect server: the per-run fixed cost of a Dagster sync.

Why: a Dagster run is a fresh process. A new SparkSession costs ~5 s plus ~3.5 s of JVM
warm-up for its first job; through a Spark Connect server that stays up (and keeps its
JVM and Python workers warm) a run's session is a gRPC client that connects in well
under a second and its sync job costs what a warm job costs (bench/latency.py and
BENCHMARKS.md hold the figures).

The server is pyspark's own (`spark-connect_2.13-*.jar` in pyspark/jars, the class
`sbin/start-connect-server.sh` runs), started with `spark-submit` in the foreground of a
child process of ours, so we own its pid. Its Python workers run this interpreter
(PYSPARK_PYTHON), so `mapInArrow` tasks can import vchan_assets. State (pid, port, log)
lives in `$VCHAN_HOME/spark-connect/`; `start()` reuses a server that is already
answering there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.deploy.processes import ServiceError
from vchan_assets.meta.embedded import free_port, pid_alive, read_ints
from vchan_assets.spark.session import cluster_conf, spark_conf

log = logging.getLogger(__name__)

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


class SparkConnectError(ServiceError):
    """The local Spark Connect server did not start or does not answer."""


def close_connect_sessions() -> None:
    """Close this process's Spark Connect sessions. One left open when its server stops
    makes the process hang at exit: PySpark's exit hook sends cleanup requests and retries
    them, with backoff, against the stopped server for minutes (`vchan demo` printed its
    summary and then did not return)."""
    if "pyspark.sql.connect.session" not in sys.modules:
        return  # this process never opened one
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    for session in {ConnectSession.getActiveSession(), ConnectSession._default_session}:
        if session is not None:
            with contextlib.suppress(Exception):  # best effort: the server may be gone already
                session.stop()


def drop_connect_session(session: object) -> None:
    """Close a Spark Connect session's client here, asking its server nothing: its calls in
    flight end at once and PySpark's exit hook skips its cleanup requests, which have no
    deadline (a run worker whose server was busy or frozen outlived its SIGTERM by minutes).
    The server drops the session's state when it times out. A classic (JVM) session, or
    None, is left as it is."""
    client = getattr(session, "client", None)
    if client is None or not hasattr(client, "is_closed") or client.is_closed:
        return
    with contextlib.suppress(Exception):  # best effort: a channel already broken is closed enough
        client.close()  # waits at most 10 s for release calls in flight, then closes the channel


def _pyspark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def connect_jar() -> Path:
    jars = sorted((_pyspark_home() / "jars").glob("spark-connect_*.jar"))
    if not jars:
        raise SparkConnectError(f"no spark-connect jar in {_pyspark_home() / 'jars'}")
    return jars[-1]


def _answers(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class LocalSparkConnect:
    """The local Spark Connect server of one VCHAN_HOME."""

    home: Path
    master: str = "local[*]"
    partitions: int = 2

    @classmethod
    def for_settings(cls, settings: Settings) -> LocalSparkConnect:
        return cls(settings.home / "spark-connect", settings.spark_master, settings.spark_partitions)

    @property
    def state_file(self) -> Path:
        return self.home / "server.json"

    @property
    def log_file(self) -> Path:
        return self.home / "server.log"

    def recorded(self) -> dict[str, int] | None:
        """The running server's pid and port; None if none is recorded or it is gone."""
        state = read_ints(self.state_file, "pid", "port")
        return state if state and pid_alive(state["pid"]) else None

    def url(self) -> str | None:
        state = self.recorded()
        return f"sc://127.0.0.1:{state['port']}" if state and _answers(state["port"]) else None

    def start(self, timeout: float = 120.0) -> str:
        """Start the server (or reuse the running one); returns its sc:// URL once it
        answers a query."""
        url = self.url()
        if url:
            return url
        self.home.mkdir(parents=True, exist_ok=True)
        port = free_port()
        settings = Settings(spark_partitions=self.partitions, spark_master=self.master)
        conf = {**spark_conf(settings), **cluster_conf(settings), "spark.app.name": "vchan-connect"}
        conf["spark.connect.grpc.binding.port"] = str(port)
        conf["spark.connect.grpc.binding.address"] = "127.0.0.1"
        args = [str(_pyspark_home() / "bin" / "spark-submit"), "--master", self.master]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        args += ["--class", SERVER_CLASS, "--name", "vchan Spark Connect server", str(connect_jar())]
        env = {
            **os.environ,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SPARK_HOME": str(_pyspark_home()),
        }
        env.pop("SPARK_REMOTE", None)
        with open(self.log_file, "ab") as out:
            process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.state_file.write_text(json.dumps({"pid": process.pid, "port": port}))
        url = f"sc://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while not _answers(port):
            if process.poll() is not None:
                raise SparkConnectError(
                    f"Spark Connect server exited ({process.returncode}); see {self.log_file}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise SparkConnectError(f"Spark Connect server did not listen within {timeout:.0f}s")
            time.sleep(0.2)
        log.info("Spark Connect server pid %s at %s", process.pid, url)
        return url

    def stop(self, timeout: float = 20.0) -> bool:
        """Stop the recorded server, after closing this process's sessions to it."""
        close_connect_sessions()
        state = self.recorded()
        if state is None:
            self.state_file.unlink(missing_ok=True)
            return False
        pid = state["pid"]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.2)
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)
        self.state_file.unlink(missing_ok=True)
        return True
