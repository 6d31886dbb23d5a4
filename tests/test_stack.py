"""The embedded stack: a real etcd process that is reused, stopped cleanly, and never left
behind when its caller crashes; the Spark session factory and its job deadline."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.deploy.processes import command_line
from vchan_assets.deploy.spark_connect import LocalSparkConnect
from vchan_assets.meta import embedded
from vchan_assets.meta.embedded import EmbeddedEtcd, EmbeddedEtcdError, healthy, pid_alive, server_version
from vchan_assets.meta.store import MetaStore
from vchan_assets.spark.session import SparkJobTimeoutError, get_spark, run_job
from vchan_assets.storage import Storage
from vchan_assets.testing.harness import cli_env
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.reader import WalReader

VCHAN = Path(sys.executable).parent / "vchan"


@pytest.mark.integration
def test_embedded_etcd_starts_healthy_and_a_second_start_reuses_it(tmp_path: Path) -> None:
    first = EmbeddedEtcd(tmp_path / "etcd").start()
    pid = first.pid
    assert pid is not None
    try:
        assert first.owned and healthy(first.endpoint)
        assert server_version(first.endpoint).startswith("3.")
        second = EmbeddedEtcd(tmp_path / "etcd").start()
        assert not second.owned and second.pid == first.pid and second.endpoint == first.endpoint
    finally:
        first.stop()
    wait_until(lambda: not pid_alive(pid), 10, "the stopped etcd to exit", interval=0.05)
    assert not (tmp_path / "etcd" / "server.json").exists()


@pytest.mark.integration
def test_a_port_taken_between_its_choice_and_etcds_bind_is_replaced_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process binds the port chosen for etcd before etcd does (CI: 15 tests of a
    module failed at setup on "bind: address already in use"): the start is tried again on
    other ports, and only that error is."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    first, free_port = [port], embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: first.pop() if first else free_port())
    try:
        server = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True).start()
        try:
            assert server.client_port != port and healthy(server.endpoint)
            assert "address already in use" in (tmp_path / "etcd" / "etcd.log").read_text()
        finally:
            server.stop()
    finally:
        taken.close()


@pytest.mark.integration
def test_only_the_tests_etcd_skips_fsync_and_a_kill_9_of_it_loses_nothing(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """The tests' etcd servers run with --unsafe-no-fsync; an EmbeddedEtcd as `vchan up`
    starts it (the default) fsyncs. A kill -9 of a server that skips fsync keeps every
    acknowledged write (the page cache holds it): what the tests that kill etcd rely on."""
    assert etcd.pid is not None and "--unsafe-no-fsync" in command_line(etcd.pid).split(" ")
    fsyncing = EmbeddedEtcd(tmp_path / "fsyncing").start()
    try:
        assert fsyncing.pid is not None and "--unsafe-no-fsync" not in command_line(fsyncing.pid)
    finally:
        fsyncing.stop()
    server = EmbeddedEtcd(tmp_path / "etcd", unsafe_no_fsync=True).start()
    try:
        store = MetaStore.connect(Settings(), [server.endpoint])
        for i in range(50):
            store.put(f"vchan/kept/{i}", str(i).encode())
        store.close()
        server.kill()
        server.restart()
        store = MetaStore.connect(Settings(), [server.endpoint])
        assert [kv.value for kv in store.list_prefix("vchan/kept/").items] == sorted(
            str(i).encode() for i in range(50)
        )
        store.close()
    finally:
        server.stop()


@pytest.mark.integration
def test_embedded_etcd_restarted_on_the_same_directory_keeps_its_data(tmp_path: Path) -> None:
    server = EmbeddedEtcd(tmp_path / "etcd").start()
    store = MetaStore.connect(Settings(), [server.endpoint])
    store.put("vchan/kept", b"1")
    store.close()
    server.stop()
    again = EmbeddedEtcd(tmp_path / "etcd").start()
    try:
        store = MetaStore.connect(Settings(), [again.endpoint])
        kv = store.get("vchan/kept")
        assert kv is not None and kv.value == b"1"
        store.close()
    finally:
        again.stop()


@pytest.mark.integration
def test_embedded_etcd_dies_with_a_caller_that_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from vchan_assets.meta.embedded import EmbeddedEtcd
        server = EmbeddedEtcd(Path({str(tmp_path / "etcd")!r})).start()
        print(server.pid, flush=True)
        time.sleep(600)
        """
    )
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert caller.stdout is not None
    etcd_pid = int(caller.stdout.readline())
    assert pid_alive(etcd_pid)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    wait_until(
        lambda: not pid_alive(etcd_pid), 10, "etcd to die with the process that started it", interval=0.05
    )


@pytest.mark.integration
def test_dagster_sensors_after_vchan_down_fail_instead_of_starting_etcd_again(tmp_path: Path) -> None:
    """A Dagster daemon left running after `vchan down` (or started before `vchan up`)
    opens the system through `open_runtime` at every sensor tick: it must not bring the
    embedded etcd back, behind the operator's back."""
    from vchan_assets.defs.runtime import open_runtime

    settings = replace(Settings(), home=tmp_path / "home", etcd_endpoints=None)
    with pytest.raises(EmbeddedEtcdError, match="vchan up"), open_runtime(settings):
        pass
    assert EmbeddedEtcd(settings.etcd_dir)._read_state() is None, "an etcd was started"

    server = EmbeddedEtcd(settings.etcd_dir).start()  # what `vchan up` does first
    try:
        with open_runtime(settings) as runtime:
            assert runtime.store.revision() > 0
        assert pid_alive(server.pid or -1), "the runtime stopped an etcd it did not start"
    finally:
        server.stop()


@pytest.mark.integration
def test_a_service_that_cannot_start_is_an_error_line_naming_its_log(tmp_path: Path) -> None:
    """`vchan up` on a machine whose Java is missing: Spark Connect exits at once, and the
    command says so with the server's log file, exit code 1 and no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(VCHAN_HOME=str(tmp_path / "home"), JAVA_HOME=str(tmp_path / "no-java"))
    try:
        up = subprocess.run([str(VCHAN), "up"], env=env, capture_output=True, text=True, timeout=180)
        assert up.returncode == 1, up.stderr
        assert "vchan up: error: Spark Connect server exited" in up.stderr, up.stderr
        assert "Traceback" not in up.stderr
        log_file = up.stderr.rsplit("see ", 1)[1].strip()
        assert Path(log_file).exists() and "no-java" in Path(log_file).read_text()
    finally:
        down = subprocess.run([str(VCHAN), "down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr


@pytest.mark.integration
def test_a_bad_setting_stops_a_command_at_start_naming_the_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(VCHAN_HOME=str(tmp_path), VCHAN_SESSION_TTL="soon")
    result = subprocess.run([str(VCHAN), "up"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "VCHAN_SESSION_TTL='soon' is invalid: expected a" in result.stderr


@pytest.mark.integration
def test_spark_session_factory_runs_a_job_within_its_deadline() -> None:
    spark = get_spark(Settings())
    assert run_job(spark, "count", lambda: spark.range(1000).count(), timeout=120) == 1000


@pytest.mark.integration
def test_a_hung_spark_job_is_cancelled_at_its_deadline() -> None:
    """A Python worker that never answers must not hang the caller (MEASURED.md saw one)."""
    spark = get_spark(Settings())

    def hang(batches):  # type: ignore[no-untyped-def]
        for batch in batches:
            time.sleep(600)
            yield batch

    df = spark.range(2, numPartitions=1).mapInArrow(hang, "id long")
    started = time.monotonic()
    with pytest.raises(SparkJobTimeoutError, match="did not finish within 3s"):
        run_job(spark, "hang", lambda: df.collect(), timeout=3)
    assert time.monotonic() - started < 60
    # The session is still usable after the cancellation.
    assert run_job(spark, "after", lambda: spark.range(10).count(), timeout=120) == 10


EXIT_AFTER_STOP = """
import sys
from pathlib import Path
from vchan_assets.config import Settings
from vchan_assets.deploy.spark_connect import LocalSparkConnect
from vchan_assets.spark.session import get_spark

server = LocalSparkConnect(Path(sys.argv[1]))
spark = get_spark(Settings(spark_remote=server.start()))
assert spark.range(10).count() == 10
server.stop()
print("stopped", flush=True)
"""


@pytest.mark.integration
def test_a_process_that_stops_its_spark_connect_server_exits_at_once(tmp_path: Path) -> None:
    """`vchan demo` stops the Spark Connect server it started while it still holds a session:
    PySpark's exit hook then retried its cleanup requests against the stopped server for
    minutes, after the demo had printed its summary. Stopping the server closes this
    process's sessions first."""
    script = subprocess.Popen(
        [sys.executable, "-c", EXIT_AFTER_STOP, str(tmp_path / "connect")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = script.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        script.kill()
        out, _ = script.communicate()
        raise AssertionError(f"the process did not exit after stopping its server:\n{out[-2000:]}") from None
    assert script.returncode == 0 and "stopped" in out, out[-2000:]


def test_a_spark_connect_record_without_its_pid_or_port_counts_as_no_server(tmp_path: Path) -> None:
    server = LocalSparkConnect(tmp_path / "spark-connect")
    server.home.mkdir(parents=True)
    for record in ("{", "[1]", "{}", '{"pid": 1}', '{"pid": "one", "port": 15002}'):
        server.state_file.write_text(record)
        assert server.recorded() is None, record
        assert server.url() is None


# --- etcd unreachable at start: VCHAN_ETCD_CONNECT_TIMEOUT ---------------------------------


def _vchan(settings: Settings, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(VCHAN), *args],
        env=cli_env(settings, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_vchan_produce_started_while_etcd_restarts_waits_for_it_and_writes_its_rows(
    private_etcd: EmbeddedEtcd, private_settings: Settings
) -> None:
    created = _vchan(private_settings, "create-collection", "--collection", "c1", "--dim", "4")
    assert created.wait(timeout=120) == 0, created.communicate()[1][-2000:]
    private_etcd.stop()
    produce = _vchan(
        private_settings, "produce", "--collection", "c1", "--rows", "100", VCHAN_ETCD_CONNECT_TIMEOUT="60"
    )
    assert produce.stderr is not None
    retrying = produce.stderr.readline()  # its first failed attempt, logged at WARNING
    assert "connect to etcd" in retrying and "retrying" in retrying, retrying
    private_etcd.restart()

    out, err = produce.communicate(timeout=120)

    assert produce.returncode == 0, err[-2000:]
    store = MetaStore.connect(private_settings)
    try:
        info = CollectionRegistry(store).get_by_name("c1")
        rows = sum(
            WalReader(Storage.from_settings(private_settings), v, info).backlog().messages
            for v in info.vchannels
        )
    finally:
        store.close()
    assert rows >= 100 + 2 * len(info.vchannels)  # the rows, their ticks and the create messages


def test_an_etcd_that_stays_down_fails_the_command_after_the_connect_timeout_saying_so(
    private_etcd: EmbeddedEtcd, private_settings: Settings
) -> None:
    private_etcd.stop()
    status = _vchan(private_settings, "status", VCHAN_ETCD_CONNECT_TIMEOUT="1")
    _, err = status.communicate(timeout=120)
    assert status.returncode == 1
    assert private_etcd.endpoint in err and "tried for 1s (VCHAN_ETCD_CONNECT_TIMEOUT)" in err, err[-2000:]
