"""The Dagster deployment of one machine: webserver + daemon (+ the local Spark Connect
server they run syncs on), as child processes we own by pid.

`DagsterService(settings, dagster_home, workspace).start()` starts
  - the local Spark Connect server (spark/connect.py), unless VCHAN_SPARK_REMOTE is set,
  - `dagster-daemon run` (sensors, run queue) and
  - `dagster-webserver` on a free loopback port,
with DAGSTER_HOME and the VCHAN_* settings in their environment, waits until the
webserver answers GraphQL, and records the pids in `$VCHAN_HOME/dagster/service.json`
so `vchan down` (another process) can stop them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import free_port, pid_alive
from vchan_assets.spark.connect import LocalSparkConnect

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
DEFAULT_WORKSPACE = REPO / "workspace.yaml"
DEFAULT_DAGSTER_HOME = REPO / "dagster_home"


class DagsterServiceError(RuntimeError):
    """The webserver or daemon did not start."""


def graphql(
    url: str, query: str, variables: dict[str, Any] | None = None, timeout: float = 30
) -> dict[str, Any]:
    """POST a GraphQL query to the webserver; the `data` of the answer."""
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(
        f"{url}/graphql", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.loads(response.read())
    if answer.get("errors"):
        raise DagsterServiceError(f"GraphQL errors: {answer['errors']}")
    return dict(answer["data"])


@dataclass
class DagsterService:
    settings: Settings
    dagster_home: Path = DEFAULT_DAGSTER_HOME
    workspace: Path = DEFAULT_WORKSPACE
    extra_env: dict[str, str] = field(default_factory=dict)
    url: str = ""

    @property
    def state_file(self) -> Path:
        return self.settings.home / "dagster" / "service.json"

    def recorded(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        return state if any(pid_alive(int(p)) for p in state.get("pids", [])) else None

    def start(self, timeout: float = 120.0) -> str:
        """Start (or find running) Spark Connect, daemon and webserver; the UI URL."""
        state = self.recorded()
        if state is not None:
            self.url = str(state["url"])
            return self.url
        settings = self.settings
        spark_pid = None
        if not settings.spark_remote:
            spark = LocalSparkConnect.for_settings(settings)
            remote = spark.start()
            spark_state = spark.recorded()
            spark_pid = spark_state["pid"] if spark_state else None
            from dataclasses import replace

            settings = replace(settings, spark_remote=remote)
        self.dagster_home.mkdir(parents=True, exist_ok=True)
        logs = settings.home / "dagster"
        logs.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **settings.to_env(),
            **self.extra_env,
            "DAGSTER_HOME": str(self.dagster_home.absolute()),
            "PYSPARK_PYTHON": sys.executable,
        }
        bin_dir = Path(sys.executable).parent
        port = free_port()
        daemon = self._spawn(
            [str(bin_dir / "dagster-daemon"), "run", "-w", str(self.workspace)], env, logs / "daemon.log"
        )
        web = self._spawn(
            [
                str(bin_dir / "dagster-webserver"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-w",
                str(self.workspace),
            ],
            env,
            logs / "webserver.log",
        )
        self.url = f"http://127.0.0.1:{port}"
        pids = [daemon.pid, web.pid]
        self.state_file.write_text(
            json.dumps(
                {"url": self.url, "pids": pids, "spark_pid": spark_pid, "spark_remote": settings.spark_remote}
            )
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                graphql(self.url, "{ version }", timeout=5)
                break
            except (OSError, urllib.error.URLError, DagsterServiceError):
                for proc, name in ((daemon, "daemon"), (web, "webserver")):
                    if proc.poll() is not None:
                        self.stop()
                        raise DagsterServiceError(
                            f"dagster {name} exited; see {logs / (name + '.log')}"
                        ) from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise DagsterServiceError(f"the webserver did not answer within {timeout:.0f}s") from None
                time.sleep(0.5)
        log.info("Dagster UI at %s (daemon pid %s, webserver pid %s)", self.url, daemon.pid, web.pid)
        return self.url

    @staticmethod
    def _spawn(args: list[str], env: dict[str, str], logfile: Path) -> subprocess.Popen[bytes]:
        with open(logfile, "ab") as out:
            return subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def stop(self, stop_spark: bool = True, timeout: float = 30.0) -> bool:
        """Stop webserver, daemon (their process groups: run workers too) and Spark Connect."""
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return False
        pids = [int(p) for p in state.get("pids", [])]
        for pid in pids:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        if stop_spark and state.get("spark_pid"):
            LocalSparkConnect.for_settings(self.settings).stop()
        self.state_file.unlink(missing_ok=True)
        return True
