"""An etcd cluster of N members on loopback (default 3), optionally with TLS on the
client URLs and authentication: for tests of failover and security, and for
`vchan demo --cluster`.

Each member is the same etcd binary as the embedded one (`meta/embedded.py`), with its
own data dir, client and peer port. Peers talk plain HTTP on loopback; clients talk
HTTPS when `tls` is given. `leader()` asks every member's status (the gRPC gateway's
`/v3/maintenance/status`); `kill(i)` is a SIGKILL, `restart(i)` starts the member again on
its ports and data. `enable_auth` creates the root user, an application user and a role
whose permission is limited to one key prefix, then turns authentication on (etcdctl).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vchan_assets.deploy.processes import spawn, stop_tree
from vchan_assets.meta.embedded import EmbeddedEtcdError, etcd_binary, free_port, member_args, pid_alive

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EtcdTls:
    """PEM files: the CA that signed the server certificate, and the server's certificate
    and key (valid for 127.0.0.1)."""

    ca: Path
    cert: Path
    key: Path


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class EtcdCluster:
    home: Path
    size: int = 3
    tls: EtcdTls | None = None
    detach: bool = False
    members: list[EtcdMember] = field(default_factory=list)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member and wait until each is healthy and there is a leader."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.members = [
            EtcdMember(f"m{i}", free_port(), free_port(), self.home / f"m{i}") for i in range(self.size)
        ]
        for member in self.members:
            self._spawn(member, "new")
        self.wait_healthy(timeout)
        log.info("etcd cluster of %d at %s", self.size, ",".join(self.endpoints))
        return self

    def _spawn(self, member: EtcdMember, state: str) -> None:
        client = f"{self.scheme}://127.0.0.1:{member.client_port}"
        peer = f"http://127.0.0.1:{member.peer_port}"
        args = member_args(member.name, member.data_dir, client, peer, self._initial_cluster(), state)
        args.append(f"--initial-cluster-token=vchan-{self.home.name}")
        if self.tls:  # server TLS; clients authenticate with a user and password
            args += [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
        member.process = spawn(args, self.home / f"{member.name}.log", detach=self.detach)

    # --- state -----------------------------------------------------------------------

    def _open(self, member: EtcdMember, path: str, body: bytes | None = None, timeout: float = 1.0) -> Any:
        context = ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else None
        url = f"{self.scheme}://{member.endpoint}{path}"
        with urllib.request.urlopen(url, data=body, timeout=timeout, context=context) as resp:
            return json.loads(resp.read())

    def healthy(self, index: int) -> bool:
        try:
            return bool(self._open(self.members[index], "/health").get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def status(self, index: int) -> dict[str, Any]:
        """One member's status: its member id, the leader's id, raft term and revision."""
        return dict(self._open(self.members[index], "/v3/maintenance/status", b"{}"))

    def leader(self) -> int | None:
        """Index of the current leader as the live members see it (None: no leader)."""
        ids: dict[str, int] = {}
        leaders: set[str] = set()
        for i, member in enumerate(self.members):
            if not member.alive:
                continue
            try:
                status = self.status(i)
            except (OSError, ValueError, urllib.error.URLError):
                continue
            ids[status["header"]["member_id"]] = i
            leaders.add(str(status.get("leader")))
        if len(leaders) != 1:
            return None
        return ids.get(leaders.pop())

    def wait_healthy(self, timeout: float = 30.0) -> int:
        """Wait until every live member is healthy and they agree on a leader; its index."""
        deadline = time.monotonic() + timeout
        while True:
            live = [i for i, m in enumerate(self.members) if m.alive]
            if live and all(self.healthy(i) for i in live):
                leader = self.leader()
                if leader is not None:
                    return leader
            if time.monotonic() > deadline:
                raise EmbeddedEtcdError(
                    f"etcd cluster not healthy within {timeout:.0f}s; see {self.home}/m*.log"
                )
            time.sleep(0.1)

    def move_leader(self, index: int, timeout: float = 15.0) -> None:
        """Hand the leadership to member `index` (etcdctl move-leader) and wait for it."""
        target = format(int(self.status(index)["header"]["member_id"]), "x")
        current = self.leader()
        if current == index:
            return
        if current is None:
            raise EmbeddedEtcdError("no etcd leader to move")
        self.etcdctl("move-leader", target, endpoints=(self.members[current].endpoint,))
        deadline = time.monotonic() + timeout
        while self.leader() != index:
            if time.monotonic() > deadline:
                raise EmbeddedEtcdError(f"leadership did not move to {self.members[index].name}")
            time.sleep(0.1)

    # --- failures ----------------------------------------------------------------------

    def kill(self, index: int) -> None:
        """SIGKILL one member (its data stays for `restart`)."""
        member = self.members[index]
        if member.process is not None:
            os.kill(member.process.pid, signal.SIGKILL)
            member.process.wait(10)

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a stopped member again on its ports and data; wait for the cluster."""
        member = self.members[index]
        if member.alive:
            raise EmbeddedEtcdError(f"etcd member {member.name} is running")
        self._spawn(member, "existing")
        self.wait_healthy(timeout)

    def stop(self) -> None:
        for member in self.members:
            if member.process is not None and pid_alive(member.process.pid):
                stop_tree(member.process.pid, timeout=10)
            member.process = None

    # --- authentication -----------------------------------------------------------------

    def etcdctl(
        self, *args: str, user: str | None = None, stdin: str = "", endpoints: tuple[str, ...] = ()
    ) -> str:
        """Run the etcdctl next to the etcd binary against every member (or `endpoints`).
        Credentials go through the environment and standard input, never the command line."""
        urls = ",".join(f"{self.scheme}://{e}" for e in endpoints or self.endpoints)
        command = [str(Path(etcd_binary()).with_name("etcdctl")), f"--endpoints={urls}"]
        if self.tls:
            command.append(f"--cacert={self.tls.ca}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
        if user:
            env["ETCDCTL_USER"] = user  # `name:password`
        result = subprocess.run(
            [*command, *args], input=stdin, capture_output=True, text=True, timeout=30, env=env
        )
        if result.returncode != 0:
            raise EmbeddedEtcdError(f"etcdctl {' '.join(args[:2])}: {result.stderr.strip()}")
        return result.stdout

    def add_user(self, user: str, password: str, root_password: str | None = None) -> None:
        """A user without any role: it may authenticate, and touch no key. Once
        authentication is on, only root may add users (`root_password`)."""
        root = f"root:{root_password}" if root_password else None
        self.etcdctl("user", "add", user, "--interactive=false", stdin=password + "\n", user=root)

    def enable_auth(self, root_password: str, user: str, password: str, prefix: str) -> None:
        """Create `root`, and `user` with a role allowed to read and write `prefix` only;
        then turn authentication on."""
        role = f"{user}-rw"
        self.add_user("root", root_password)
        self.etcdctl("role", "add", "root")
        self.etcdctl("user", "grant-role", "root", "root")
        self.add_user(user, password)
        self.etcdctl("role", "add", role)
        self.etcdctl("role", "grant-permission", role, "--prefix=true", "readwrite", prefix)
        self.etcdctl("user", "grant-role", user, role)
        self.etcdctl("auth", "enable")
