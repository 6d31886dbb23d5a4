"""The supervisor behind `vchan up --supervise`: a service that dies is started again, a
heal that fails is retried with a doubling delay, and `DagsterService.missing` reads
which recorded services died (real processes, killed with SIGKILL)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.deploy.service import DagsterService, DagsterServiceError, graphql
from vchan_assets.deploy.supervisor import Supervisor
from vchan_assets.meta.embedded import pid_alive
from vchan_assets.testing.waiting import wait_until


def test_a_killed_service_is_started_again(tmp_path: Path) -> None:
    service = [subprocess.Popen(["sleep", "600"])]

    def missing() -> list[str]:
        return [] if pid_alive(service[-1].pid) else ["sleeper"]

    def heal() -> None:
        service.append(subprocess.Popen(["sleep", "600"]))

    supervisor = Supervisor(missing, heal, interval=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    runner.start()
    try:
        first = service[0]
        first.kill()
        first.wait()
        wait_until(
            lambda: len(service) >= 2,
            30,
            "the supervisor to start the service again",
            interval=0.05,
            describe=lambda: f"restarts {supervisor.restarts}",
        )
        assert len(service) == 2 and pid_alive(service[1].pid)
        assert [names for _, names in supervisor.restarts] == [("sleeper",)]
    finally:
        stop.set()
        runner.join(10)
        for proc in service:
            proc.kill()
            proc.wait()


def test_a_heal_that_fails_is_retried_with_a_doubling_delay_reset_by_a_success() -> None:
    attempts: list[int] = []

    def heal() -> None:
        attempts.append(1)
        if len(attempts) <= 4:
            raise OSError("port already in use")

    supervisor = Supervisor(lambda: ["dagster-daemon"], heal, interval=5.0, backoff=1.0, max_backoff=6.0)
    delays = [supervisor.step() for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 6.0, 5.0, 5.0]
    assert supervisor.failures == 0 and len(supervisor.restarts) == 2


def test_the_dagster_service_reports_which_recorded_process_died(settings: Settings) -> None:
    service = DagsterService(settings)
    assert service.missing() == []  # never started here: nothing to supervise
    alive = subprocess.Popen(["sleep", "600"], start_new_session=True)
    dead = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        service.state_file.parent.mkdir(parents=True, exist_ok=True)
        service.state_file.write_text(json.dumps({"url": "", "pids": [dead.pid, alive.pid]}))
        assert service.missing() == []
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait()
        assert service.missing() == ["dagster-daemon"]
    finally:
        for proc in (alive, dead):
            proc.kill()
            proc.wait()


def test_a_half_written_or_foreign_service_record_counts_as_no_service(settings: Settings) -> None:
    service = DagsterService(settings)
    service.state_file.parent.mkdir(parents=True, exist_ok=True)
    for record in ('{"pids": [', "[4242]", "null"):
        service.state_file.write_text(record)
        assert service.recorded() is None
        assert service.missing() == []
        assert service.stop() is False


# A leader that exits on SIGTERM, with a child in its process group that ignores it (the
# child prints its pid once it does).
STRAGGLER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import os, signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(600)']); "
    "time.sleep(600)"
)


def test_stopping_a_service_kills_the_rest_of_its_process_group_after_the_leader_exits() -> None:
    """The daemon or webserver exits on SIGTERM; a code server of its process group that
    does not is killed too, not left running with its memory."""
    leader = subprocess.Popen(
        [sys.executable, "-c", STRAGGLER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    assert pid_alive(child)

    DagsterService._stop_pids([leader.pid], timeout=30)

    leader.wait(10)
    wait_until(
        lambda: not pid_alive(child), 10, "the leader's straggling child to be stopped with it", interval=0.05
    )


# A leader that refuses SIGTERM and holds 1.5 GB: once SIGKILLed, the kernel frees its memory
# before the process is gone (a Dagster daemon's exit under load took long enough to matter).
STUBBORN = (
    "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "b = bytearray(1536 << 20); [b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; "
    "print('ready', flush=True); time.sleep(600)"
)


@pytest.mark.integration  # a child process holding 1.5 GB
def test_a_leader_that_outlives_sigterm_is_gone_when_stopping_it_returns() -> None:
    """`_stop_pids` kills what SIGTERM did not stop and returns once it is gone: the heal of
    a hung daemon starts a new one only when the old one is not alive, and found the killed
    one still there (CI: the hung-daemon test's heal left the deployment without a daemon,
    and the five tests after it failed)."""
    leader = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "ready"

        DagsterService._stop_pids([leader.pid], timeout=0.5)

        assert not pid_alive(leader.pid), "the killed leader was still alive when the stop returned"
    finally:
        leader.kill()
        leader.wait(10)


def test_a_webserver_error_status_is_an_error_with_what_the_webserver_said() -> None:
    """`graphql` against a server that answers 500: DagsterServiceError carrying the status
    and the answer's body (a bare "HTTP Error 500" told a failed test nothing)."""

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"errors": [{"message": "connection to the storage was lost"}]}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(DagsterServiceError, match="HTTP 500: .*connection to the storage was lost"):
            graphql(url, "{ version }")
    finally:
        server.shutdown()
        server.server_close()
