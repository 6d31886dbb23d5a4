"""The Dagster deployment of one machine: webserver + daemon (+ the local Spark Connect
server they run syncs on), as child processes we own by pid.

`DagsterService(settings, dagster_home, workspace).start()` starts
  - the local Spark Connect server (deploy/spark_connect.py), unless VCHAN_SPARK_REMOTE is set,
  - `dagster-daemon run` (sensors, run queue) and
  - `dagster-webserver` on a free loopback port,
with DAGSTER_HOME and the VCHAN_* settings in their environment, waits until the
webserver answers GraphQL, and records the pids in `$VCHAN_HOME/dagster/service.json`
so `vchan down` (another process) can stop them. Started again, it starts only what is
missing or dead and leaves the healthy ones alone (`vchan up` heals).

The instance keeps its runs, event logs and schedules in SQLite files under its
DAGSTER_HOME by default (Dagster's files, opened by defs/instance_storage.py, which checks
their schema once per process); on a cluster, in PostgreSQL (`storage`, or the setting
VCHAN_DAGSTER_POSTGRES_URL: its `dagster.yaml` gets a `storage: postgres:` section), which
every daemon and webserver of the cluster shares. deploy/postgres.py starts a server.
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.deploy.postgres import postgres_storage
from vchan_assets.deploy.processes import ServiceError
from vchan_assets.deploy.spark_connect import LocalSparkConnect
from vchan_assets.meta.embedded import free_port, pid_alive, read_record
from vchan_assets.meta.errors import MetaError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import DAGSTER_ADDRESS, NodeSession

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
DEFAULT_WORKSPACE = REPO / "workspace.yaml"
# The instance's configuration (run queue, sensors, run monitoring); the instance itself,
# its runs, cursors and materializations, lives under VCHAN_HOME (`instance_home`).
INSTANCE_CONFIG = REPO / "dagster_home" / "dagster.yaml"


def local_storage(dagster_home: Path) -> dict[str, Any]:
    """The `storage:` section of an instance that keeps its SQLite files in `dagster_home`,
    where Dagster's default storage keeps them: Dagster's SQLite storage, opened without
    its schema checks after the first opening in a process (defs/instance_storage.py)."""
    storage = {"module": "vchan_assets.defs.instance_storage", "class": "SqliteStorage"}
    return {"custom": {**storage, "config": {"base_dir": str(dagster_home)}}}


def write_instance_config(dagster_home: Path, storage: dict[str, Any] | None = None) -> Path:
    """`dagster.yaml` of the instance at `dagster_home`: ours (INSTANCE_CONFIG), with the
    `storage:` section `storage` when given (PostgreSQL for a cluster: deploy/postgres.py's
    `storage_config()`), otherwise `local_storage(dagster_home)`."""
    import yaml

    text = INSTANCE_CONFIG.read_text()
    text += "\n# The instance's runs, event logs and schedules (set by the deployment).\n"
    text += yaml.safe_dump({"storage": storage or local_storage(dagster_home)}, sort_keys=False)
    dagster_home.mkdir(parents=True, exist_ok=True)
    target = dagster_home / "dagster.yaml"
    target.write_text(text)
    return target


def instance_home(settings: Settings) -> Path:
    """DAGSTER_HOME of the deployment of `settings.home`: the Dagster history (runs, sensor
    cursors, materializations, partition keys) belongs to that cluster's etcd and storage,
    so a new VCHAN_HOME (`make clean`) starts both afresh. Vchannel names repeat across
    fresh clusters (ids restart); a history shared between clusters compared one cluster's
    checkpoints with another's."""
    return settings.home / "dagster" / "instance"


class DagsterServiceError(ServiceError):
    """The webserver or daemon did not start."""


def graphql(
    url: str, query: str, variables: dict[str, Any] | None = None, timeout: float = 30
) -> dict[str, Any]:
    """POST a GraphQL query to the webserver; the `data` of the answer. DagsterServiceError
    with the webserver's own words when it answers with an error status or GraphQL errors."""
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(
        f"{url}/graphql", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        said = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, TypeError, KeyError):  # the errors' messages, if JSON
            said = "; ".join(str(e["message"]) for e in json.loads(said)["errors"])
        raise DagsterServiceError(f"the webserver at {url} answered HTTP {exc.code}: {said[:2000]}") from exc
    if answer.get("errors"):
        raise DagsterServiceError(f"GraphQL errors: {answer['errors']}")
    return dict(answer["data"])


# Dagster's daemons write a heartbeat every 30 s; one older than this is a daemon process
# that is alive but no longer runs its loops (stopped, deadlocked, starved).
HEARTBEAT_STALE_AFTER = 90.0


@dataclass(frozen=True)
class DaemonHeartbeats:
    """Seconds since each required daemon of a Dagster instance last wrote its heartbeat,
    and those whose heartbeat reports errors; `unreadable`: why the instance could not be read."""

    ages: dict[str, float]
    errors: tuple[str, ...] = ()
    unreadable: str = ""

    @property
    def stalest(self) -> tuple[str, float] | None:
        """The daemon with the oldest heartbeat past HEARTBEAT_STALE_AFTER, if any: hung."""
        stale = [(t, age) for t, age in self.ages.items() if age > HEARTBEAT_STALE_AFTER]
        return max(stale, key=lambda ta: ta[1]) if stale else None


def postgres_unanswered(dagster_home: Path) -> str:
    """Why the PostgreSQL of the instance at `dagster_home` does not answer ("" when it does,
    or when the instance is not on a `postgres_url`). Dagster, opening that instance, would
    retry its connection with backoff for seconds before it fails: a health check (the
    supervisor's `missing()`, `vchan status`) asks the server once, with a short timeout."""
    import yaml

    try:
        config = yaml.safe_load((dagster_home / "dagster.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    url = ((config.get("storage") or {}).get("postgres") or {}).get("postgres_url")
    if not isinstance(url, str):
        return ""
    import psycopg2

    scheme, _, rest = url.partition("://")
    try:
        psycopg2.connect(f"{scheme.split('+')[0]}://{rest}", connect_timeout=2).close()
    except psycopg2.OperationalError as exc:
        return f"its PostgreSQL does not answer ({' '.join(str(exc).split())})"
    return ""


def daemon_heartbeats(dagster_home: Path, now: float) -> DaemonHeartbeats:
    import dagster as dg

    if why := postgres_unanswered(dagster_home):
        return DaemonHeartbeats({}, unreadable=why)
    try:
        with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
            beats = instance.get_daemon_heartbeats()
            required = sorted(instance.get_required_daemon_types())
    except Exception as exc:  # an unreadable instance must not break a status report
        return DaemonHeartbeats({}, unreadable=str(exc))
    ages = {t: now - beats[t].timestamp for t in required if t in beats}
    return DaemonHeartbeats(ages, tuple(t for t in ages if beats[t].errors))


def daemon_state(pid: int, dagster_home: Path, now: float) -> str:
    """A live daemon's state from its heartbeats in the instance at `dagster_home`."""
    beats = daemon_heartbeats(dagster_home, now)
    if beats.unreadable:
        return f"up (pid {pid}; its heartbeats are unreadable: {beats.unreadable})"
    if not beats.ages:
        return f"starting (pid {pid}, no heartbeat yet)"
    if beats.stalest is not None:
        kind, age = beats.stalest
        return (
            f"hung (pid {pid} is alive but its {kind} daemon's last heartbeat is {age:.0f} s old; "
            "run `vchan up`: it replaces a hung daemon)"
        )
    suffix = f"; errors reported by {', '.join(beats.errors)}" if beats.errors else ""
    return f"up (pid {pid}, heartbeat {min(beats.ages.values()):.0f} s ago{suffix})"


def _pids(state: dict[str, Any]) -> list[int]:
    """The daemon's and the webserver's pids, as `DagsterService.start` recorded them."""
    return [int(p) for p in state.get("pids", [])]


STRAGGLER_GRACE = 3.0  # seconds the rest of a process group gets after its leader exited
KILLED_EXIT_WAIT = 10.0  # seconds a SIGKILLed leader gets to be gone before `_stop_pids` returns


def _group_alive(pgid: int) -> bool:
    """Some process of the group `pgid` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class DagsterService:
    settings: Settings
    dagster_home: Path | None = None  # None: instance_home(settings)
    workspace: Path = DEFAULT_WORKSPACE
    extra_env: dict[str, str] = field(default_factory=dict)
    url: str = ""
    # The instance's `storage:` section (None: VCHAN_DAGSTER_POSTGRES_URL's database if
    # set, else SQLite files in dagster_home: `local_storage`). dagster.yaml is written
    # with it at every start.
    storage: dict[str, Any] | None = None
    # True: the daemon keeps its code server while it lives (deploy/daemon.py); False:
    # Dagster's own `dagster-daemon`, which starts a new one every minute (picks up changed
    # code without a restart).
    keep_code_server: bool = True

    def __post_init__(self) -> None:
        if self.dagster_home is None:
            self.dagster_home = instance_home(self.settings)
        if self.storage is None and self.settings.dagster_postgres_url:
            self.storage = postgres_storage(self.settings.dagster_postgres_url)

    @property
    def home(self) -> Path:
        """DAGSTER_HOME of this deployment."""
        assert self.dagster_home is not None
        return self.dagster_home

    @property
    def state_file(self) -> Path:
        return self.settings.home / "dagster" / "service.json"

    def recorded(self) -> dict[str, Any] | None:
        state = read_record(self.state_file)
        return state if any(pid_alive(p) for p in _pids(state)) else None

    def _create_storage(self, env: dict[str, str]) -> None:
        """Create (or migrate) the instance's storage before the daemon and the webserver
        start: both did it at once on a new SQLite storage and could race on its migration
        table ("alembic_version has more than one head"), failing whoever opened it next.
        Only when neither runs: one that runs has opened the storage already, and the heal
        of the other (a daemon killed or hung, a webserver killed) would otherwise wait for
        one more Python process importing Dagster (seconds of CPU, tens of seconds on a
        loaded machine) before it starts what is missing."""
        log.info("creating the Dagster instance's storage in %s", self.home)
        subprocess.run(
            [sys.executable, "-c", "import dagster; dagster.DagsterInstance.get().dispose()"],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self, timeout: float = 120.0, now: float | None = None) -> str:
        """Start whatever of Spark Connect, daemon and webserver is not running, leaving the
        running ones alone, and return the UI URL once the webserver answers. Run again, it
        heals: a daemon or webserver that died since (kill -9, OOM) is started again, and so
        is a daemon that is hung (alive, its heartbeats stopped; `now`: the time to judge
        them at)."""
        settings, spark_pid = self._spark()
        state = read_record(self.state_file)
        if state and state.get("spark_remote") != settings.spark_remote:
            # They would run syncs on a Spark Connect server that is gone: restart both.
            self._stop_pids(_pids(state), timeout=30.0)
            state = {}
        daemon_pid, web_pid = (_pids(state) + [0, 0])[:2]
        if self._hung(daemon_pid, now):
            log.warning("dagster daemon pid %s is hung (no heartbeat): restarting it", daemon_pid)
            self._stop_pids([daemon_pid], timeout=10.0)
            # As after `stop()`: no Dagster-hosted node outlives its daemon. Its loops left on
            # the SIGTERM, but a node sensor tick the code server was still evaluating
            # registered a new node, whose session would hold for its TTL (60 s) with nobody
            # behind it: the new daemon's coordinator gave it channels, and they waited.
            end_dagster_hosted_sessions(self.settings)
        port = int(state.get("port") or 0)
        self.home.mkdir(parents=True, exist_ok=True)
        write_instance_config(self.home, self.storage)
        logs = settings.home / "dagster"
        logs.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **settings.to_env(),
            **self.extra_env,
            "DAGSTER_HOME": str(self.home.absolute()),
            "PYSPARK_PYTHON": sys.executable,
        }
        if not (pid_alive(daemon_pid) or pid_alive(web_pid)):
            self._create_storage(env)
        bin_dir = Path(sys.executable).parent
        spawned: dict[str, subprocess.Popen[bytes]] = {}
        if not pid_alive(daemon_pid):
            spawned["daemon"] = self._spawn(
                [*self._daemon_command(bin_dir), "run", "-w", str(self.workspace)],
                env,
                logs / "daemon.log",
            )
            daemon_pid = spawned["daemon"].pid
        if not pid_alive(web_pid):
            port = free_port()
            args = ["-h", "127.0.0.1", "-p", str(port), "-w", str(self.workspace)]
            spawned["webserver"] = self._spawn(
                [str(bin_dir / "dagster-webserver"), *args], env, logs / "webserver.log"
            )
            web_pid = spawned["webserver"].pid
        self.url = f"http://127.0.0.1:{port}"
        record = {
            "url": self.url,
            "port": port,
            "pids": [daemon_pid, web_pid],
            "spark_pid": spark_pid,
            "spark_remote": settings.spark_remote,
            "dagster_home": str(self.dagster_home),
        }
        self.state_file.write_text(json.dumps(record))
        if spawned:
            log.info("started dagster %s", " and ".join(spawned))
        self._wait_until_answering(spawned, logs, timeout)
        log.info("Dagster UI at %s (daemon pid %s, webserver pid %s)", self.url, daemon_pid, web_pid)
        return self.url

    def _daemon_command(self, bin_dir: Path) -> list[str]:
        if self.keep_code_server:
            return [sys.executable, "-m", "vchan_assets.deploy.daemon"]
        return [str(bin_dir / "dagster-daemon")]

    def missing(self, now: float | None = None) -> list[str]:
        """The services `start()` recorded that are no longer running, or hung (the daemon
        alive without heartbeats) ([] if it never ran here, or `vchan down` stopped them):
        what a supervisor restarts."""
        state = read_record(self.state_file)
        if not state:
            return []
        names = ("dagster-daemon", "dagster-webserver")
        pids = _pids(state)
        down = [name for name, pid in zip(names, pids, strict=False) if not pid_alive(pid)]
        if pids and self._hung(pids[0], now):
            down.append("dagster-daemon (hung)")
        spark_pid = state.get("spark_pid")
        if spark_pid and not pid_alive(int(spark_pid)):
            down.append("spark-connect")
        return down

    def _hung(self, daemon_pid: int, now: float | None) -> bool:
        """The daemon is alive but one of its heartbeats is stale."""
        if not daemon_pid or not pid_alive(daemon_pid) or self.dagster_home is None:
            return False
        beats = daemon_heartbeats(self.dagster_home, time.time() if now is None else now)
        return beats.stalest is not None

    def _spark(self) -> tuple[Settings, int | None]:
        """The settings with the Spark Connect URL (the local server, started if not
        running, unless VCHAN_SPARK_REMOTE names one) and that server's pid."""
        if self.settings.spark_remote:
            return self.settings, None
        spark = LocalSparkConnect.for_settings(self.settings)
        remote = spark.start()
        spark_state = spark.recorded()
        return replace(self.settings, spark_remote=remote), spark_state["pid"] if spark_state else None

    def _wait_until_answering(
        self, spawned: dict[str, subprocess.Popen[bytes]], logs: Path, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                graphql(self.url, "{ version }", timeout=5)
                return
            except (OSError, urllib.error.URLError, DagsterServiceError):
                for name, proc in spawned.items():
                    if proc.poll() is not None:
                        self.stop()
                        raise DagsterServiceError(
                            f"dagster {name} exited; see {logs / (name + '.log')}"
                        ) from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise DagsterServiceError(f"the webserver did not answer within {timeout:.0f}s") from None
                time.sleep(0.5)

    @staticmethod
    def _stop_pids(pids: list[int], timeout: float) -> None:
        """SIGTERM each process group, SIGKILL what is left of the groups after `timeout`,
        or STRAGGLER_GRACE after their leaders exited: the leader (daemon, webserver) exits
        on SIGTERM, but a code server of its group did not always, and lived on with its
        memory once the leader was gone."""
        groups = [pid for pid in pids if pid_alive(pid)]
        for pid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(pid_alive(p) for p in groups) and time.monotonic() < deadline:
            time.sleep(0.2)
        grace = min(deadline, time.monotonic() + STRAGGLER_GRACE)
        while any(_group_alive(p) for p in groups) and time.monotonic() < grace:
            time.sleep(0.2)
        for pid in groups:  # a group id is not reused while a member of the group lives
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        # A killed process is still there while the kernel frees its memory (a daemon's takes
        # a moment): a caller that starts a replacement only when the old one is gone (the
        # heal of a hung daemon) found it alive, started none, and left the stack without a
        # daemon. So return once the leaders are gone (SIGKILL cannot be refused).
        gone = time.monotonic() + KILLED_EXIT_WAIT
        while any(pid_alive(p) for p in groups) and time.monotonic() < gone:
            time.sleep(0.02)

    @staticmethod
    def _spawn(args: list[str], env: dict[str, str], logfile: Path) -> subprocess.Popen[bytes]:
        with open(logfile, "ab") as out:
            return subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def stop(self, stop_spark: bool = True, timeout: float = 30.0) -> bool:
        """Stop webserver, daemon (their process groups: run workers too) and Spark Connect."""
        state = read_record(self.state_file)
        if not state:
            return False
        self._stop_pids(_pids(state), timeout)
        end_dagster_hosted_sessions(self.settings)
        if stop_spark and state.get("spark_pid"):
            LocalSparkConnect.for_settings(self.settings).stop()
        self.state_file.unlink(missing_ok=True)
        return True


def end_dagster_hosted_sessions(settings: Settings) -> int:
    """End the sessions of Dagster-hosted DataNodes once every Dagster process is gone; how
    many were left.

    Each node's sync loop revokes its session when the stop interrupts it, but a sensor
    tick the code server was still evaluating finds that session gone and registers a new
    node: with no daemon left to run it, its session would hold for its TTL (60 s) and
    the coordinator would assign channels to it. No Dagster-hosted node outlives the
    deployment, so every `dagster:*` session left is ended here. An etcd that cannot be
    reached is only logged: the sessions then end with their TTL."""
    ended = 0
    try:
        store = MetaStore.connect(settings)
    except MetaError as exc:  # no endpoints: the embedded etcd is already down with the stack
        log.info("no Dagster-hosted node's session to end: %s", exc)
        return 0
    try:
        found, _ = store.list_models(store.keys.datanode_session.prefix, NodeSession, skip_malformed=True)
        for d in found:
            if d.model.address.startswith(DAGSTER_ADDRESS):
                if d.kv.lease:
                    store.revoke(d.kv.lease)
                else:
                    store.delete(d.kv.key)
                ended += 1
                log.info("ended the session of Dagster-hosted node %s", d.model.node_id)
    except MetaError as exc:
        log.warning("could not end the Dagster-hosted nodes' sessions (they expire with their TTL): %s", exc)
    finally:
        store.close()
    return ended
