"""A PostgreSQL server on loopback for the Dagster instance of a cluster: its runs, event
logs (materializations, checks), schedules and sensor cursors, shared by every daemon and
webserver of the deployment (SQLite, the embedded default, serves one machine only).

`PostgresServer(home).start()` creates the database cluster under `{home}/data` on its
first start (`initdb`, one superuser `vchan`, trust authentication: it listens on
127.0.0.1 only, no Unix socket), starts `postgres` on a loopback port, creates the
database `dagster` if missing and records pid and port in `{home}/postgres.json`. Started
again on the same home (after `kill()`, a crash, a reboot) it reuses the data and the
port: the instance's `dagster.yaml` (`storage_config()`) stays valid, and the daemon and
the webserver reconnect. `missing()` and `start()` are what a supervisor calls.

The server binaries are Debian's `postgresql` package's (`make system-deps` installs it):
`initdb` and `postgres` on PATH, or under /usr/lib/postgresql/<version>/bin. PostgreSQL
refuses to run as root; run as root (CI, containers), the server runs as the package's
`postgres` user, with the capability to traverse root-owned directories above its data
(pytest's temporary directories are mode 0700).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vchan_assets.deploy.processes import ServiceError, spawn, stop_tree
from vchan_assets.meta.embedded import SETPRIV, free_port, pid_alive, read_record

log = logging.getLogger(__name__)

USER = "vchan"
DATABASE = "dagster"
SERVER_USER = "postgres"  # the system user of Debian's package, for a server started as root


class PostgresError(ServiceError):
    """The PostgreSQL server did not start, or is not installed."""


def postgres_binary(name: str) -> str:
    """`initdb`/`postgres`/`pg_ctl` of the installed server: on PATH, else the newest
    version under /usr/lib/postgresql (Debian does not put them on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    if versions:
        return str(versions[-1])
    raise PostgresError(f"PostgreSQL's {name} not found: install Debian's postgresql (make system-deps does)")


def postgres_storage(url: str) -> dict[str, Any]:
    """The `storage:` section of a Dagster instance whose database is `url`
    (VCHAN_DAGSTER_POSTGRES_URL, or a PostgresServer's). The URL is given to SQLAlchemy with
    psycopg2, the driver dagster-postgres installs: SQLAlchemy's default PostgreSQL driver
    is psycopg 3, which is not installed."""
    scheme, rest = url.split("://", 1)
    if "+" not in scheme:
        scheme = "postgresql+psycopg2"
    return {"postgres": {"postgres_url": f"{scheme}://{rest}"}}


def _as_server_user(args: list[str], detach: bool = True) -> tuple[list[str], bool]:
    """`args` run as the `postgres` user when we are root (PostgreSQL refuses root), and
    whether `spawn` must still detach it. A change of user clears the parent-death signal
    that `spawn` sets, so as root setpriv sets it after the change (unless `detach`)."""
    if os.geteuid() != 0:
        return args, detach
    if SETPRIV is None:
        raise PostgresError(
            "running PostgreSQL as root needs util-linux's setpriv to drop to the postgres user"
        )
    caps = "+dac_override,+dac_read_search"
    entry = pwd.getpwnam(SERVER_USER)
    death = [] if detach else ["--pdeathsig", "KILL"]
    wrapped = [
        SETPRIV,
        *death,
        f"--reuid={entry.pw_uid}",
        f"--regid={entry.pw_gid}",
        "--clear-groups",
        f"--inh-caps={caps}",
        f"--ambient-caps={caps}",
        *args,
    ]
    return wrapped, True


@dataclass
class PostgresServer:
    home: Path
    port: int = 0
    detach: bool = False
    process: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def record_file(self) -> Path:
        return self.home / "postgres.json"

    @property
    def log_file(self) -> Path:
        return self.home / "postgres.log"

    @property
    def url(self) -> str:
        """The libpq URL of the Dagster database (psql, psycopg2.connect)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def storage_config(self) -> dict[str, Any]:
        """The `storage:` section of a Dagster instance on this server."""
        return postgres_storage(self.url)

    def _initdb(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            entry = pwd.getpwnam(SERVER_USER)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self.data_dir.chmod(0o700)
        args = [postgres_binary("initdb"), "-D", str(self.data_dir), "-U", USER, "--auth=trust"]
        args += ["-E", "UTF8", "--no-locale", "--no-sync"]
        done = subprocess.run(_as_server_user(args)[0], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise PostgresError(f"initdb of {self.data_dir} failed: {done.stderr.strip()[-2000:]}")

    def _answers(self, database: str = "postgres") -> bool:
        import psycopg2

        try:
            psycopg2.connect(
                host="127.0.0.1", port=self.port, user=USER, dbname=database, connect_timeout=2
            ).close()
        except psycopg2.OperationalError:
            return False
        return True

    def _pid(self) -> int:
        return int(read_record(self.record_file).get("pid") or 0)

    def running(self) -> bool:
        return pid_alive(self._pid())

    def start(self, timeout: float = 60.0) -> str:
        """Start the server unless it runs (initdb on the first start); its database URL."""
        record = read_record(self.record_file)
        self.port = self.port or int(record.get("port") or 0) or free_port()
        if self.running() and self._answers():
            return self.url
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)  # left by a kill -9
        args = [postgres_binary("postgres"), "-D", str(self.data_dir), "-p", str(self.port)]
        args += ["-h", "127.0.0.1", "-c", "unix_socket_directories=", "-c", "max_connections=200"]
        command, detach = _as_server_user(args, self.detach)
        self.process = spawn(command, self.log_file, detach=detach)
        self.record_file.write_text(json.dumps({"pid": self.process.pid, "port": self.port}))
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise PostgresError(f"PostgreSQL did not start on 127.0.0.1:{self.port}; see {self.log_file}")
            time.sleep(0.2)
        self._create_database()
        log.info("PostgreSQL at 127.0.0.1:%d (pid %d)", self.port, self.process.pid)
        return self.url

    def _create_database(self) -> None:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=USER, dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cursor:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
                if cursor.fetchone() is None:
                    cursor.execute(f"CREATE DATABASE {DATABASE}")
        finally:
            conn.close()

    def missing(self) -> list[str]:
        """["postgres"] when the recorded server died ([] when it runs or never ran here)."""
        return ["postgres"] if self._pid() and not self.running() else []

    def kill(self) -> None:
        """kill -9 of the server's postmaster (what a crash does); its data stays."""
        pid = self._pid()
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            if self.process is not None and self.process.pid == pid:
                self.process.wait(10)
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server (a fast shutdown: SIGINT) and its backends; keep the record's port."""
        pid = self._pid()
        if pid_alive(pid):
            os.kill(pid, signal.SIGINT)
            deadline = time.monotonic() + 20
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(pid):
                stop_tree(pid, timeout=5)
        if self.process is not None:
            self.process.wait(10)
        self.process = None
        self.record_file.write_text(json.dumps({"pid": 0, "port": self.port}))
