"""A STARTED run whose worker process died is marked failed and frees its vchannel; so is a
STARTING run whose code server died before it started the process. Run monitoring's start
timeout fails a run that never started, and leaves a slow start alone.

A real Dagster instance and real processes: the run's worker is a process that reported its
pid the way Dagster's run worker does, then was killed -9."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType, EngineEventData
from dagster._core.storage.dagster_run import DagsterRun
from dagster._core.storage.tags import GRPC_INFO_TAG
from dagster._daemon.monitoring import run_monitoring

from vchan_assets.defs.orphans import (
    UNSTARTED_GRACE,
    fail_orphaned_runs,
    launching_server_gone,
    orphaned_runs_sensor,
)
from vchan_assets.defs.sync.jobs import CHANNEL_TAG, sync_job
from vchan_assets.defs.sync.sensor import busy_channels
from vchan_assets.deploy.service import INSTANCE_CONFIG


def started_run(
    instance: dg.DagsterInstance,
    channel: str,
    pid: int,
    status: dg.DagsterRunStatus = dg.DagsterRunStatus.STARTED,
) -> DagsterRun:
    run = instance.add_run(DagsterRun(job_name=sync_job.name, status=status, tags={CHANNEL_TAG: channel}))
    instance.report_engine_event(
        f"Started process for run (pid: {pid}).", run, EngineEventData.in_process(pid)
    )
    return run


def launched_run(instance: dg.DagsterInstance, tags: dict[str, str]) -> tuple[DagsterRun, float]:
    """A run the daemon launched (STARTING, as Dagster's `launch_run` reports it) whose
    process has not reported its pid; and its launch time."""
    run = instance.add_run(
        DagsterRun(job_name=sync_job.name, status=dg.DagsterRunStatus.NOT_STARTED, tags=tags)
    )
    starting = DagsterEvent(event_type_value=DagsterEventType.PIPELINE_STARTING.value, job_name=run.job_name)
    instance.report_dagster_event(starting, run_id=run.run_id)
    launched = instance.get_run_stats(run.run_id).launch_time
    assert launched is not None
    return run, launched


def dead_pid() -> int:
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    return worker.pid


def test_a_started_run_whose_worker_was_killed_is_marked_failed_and_frees_its_channel(
    instance: dg.DagsterInstance,
) -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        orphan = started_run(instance, "by-dml-0_0v0", dead_pid())
        running = started_run(instance, "by-dml-1_0v1", alive.pid)
        assert busy_channels(instance) == {"by-dml-0_0v0", "by-dml-1_0v1"}

        result = orphaned_runs_sensor(dg.build_sensor_context(instance=instance))

        assert isinstance(result, dg.SkipReason) and orphan.run_id in (result.skip_message or "")
        failed = instance.get_run_by_id(orphan.run_id)
        assert failed is not None and failed.status == dg.DagsterRunStatus.FAILURE
        still = instance.get_run_by_id(running.run_id)
        assert still is not None and still.status == dg.DagsterRunStatus.STARTED
        assert busy_channels(instance) == {"by-dml-1_0v1"}
        assert fail_orphaned_runs(instance) == []  # once
    finally:
        alive.kill()
        alive.wait()


def test_a_starting_run_whose_process_died_before_it_reported_its_start_is_marked_failed(
    instance: dg.DagsterInstance,
) -> None:
    """Killed between "Started process for run" and RUN_START: STARTING for ever, seen in the
    deployment test when the daemon's process group was killed -9."""
    orphan = started_run(instance, "by-dml-0_0v0", dead_pid(), dg.DagsterRunStatus.STARTING)
    assert fail_orphaned_runs(instance) == [orphan.run_id]
    failed = instance.get_run_by_id(orphan.run_id)
    assert failed is not None and failed.status == dg.DagsterRunStatus.FAILURE
    assert busy_channels(instance) == set()


def test_a_started_run_that_has_not_reported_its_pid_yet_is_left_alone(instance: dg.DagsterInstance) -> None:
    run = instance.add_run(DagsterRun(job_name=sync_job.name, status=dg.DagsterRunStatus.STARTED))
    assert fail_orphaned_runs(instance) == []
    current = instance.get_run_by_id(run.run_id)
    assert current is not None and current.status == dg.DagsterRunStatus.STARTED


def test_run_monitoring_lets_a_slow_start_go_on_and_fails_a_run_that_never_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's start (its process, the instance, the import of the definitions: ~5 CPU s)
    took 60-100 s of wall time on the two cores of a loaded machine, and run monitoring's
    start timeout, then 60 s, failed such healthy starts (START_TIMEOUT) over and over. Run
    monitoring as the daemon runs it, on this project's dagster.yaml, its clock moved on: a
    run 90 s into its start goes on; one 190 s in (its daemon killed mid-launch) is failed."""
    shutil.copy(INSTANCE_CONFIG, tmp_path / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        run, launched = launched_run(instance, {})

        def monitor_at(seconds: float) -> dg.DagsterRunStatus:
            monkeypatch.setattr(run_monitoring, "get_current_timestamp", lambda: launched + seconds)
            (record,) = instance.get_run_records(dg.RunsFilter(run_ids=[run.run_id]))
            if record.dagster_run.status == dg.DagsterRunStatus.STARTING:
                run_monitoring.monitor_starting_run(instance, record, logging.getLogger(__name__))
            current = instance.get_run_by_id(run.run_id)
            assert current is not None
            return current.status

        assert monitor_at(90) == dg.DagsterRunStatus.STARTING
        assert monitor_at(190) == dg.DagsterRunStatus.FAILURE
        failed = instance.get_run_by_id(run.run_id)
        assert failed is not None and failed.tags.get("dagster/failure_reason") == "START_TIMEOUT"


def test_a_starting_run_whose_code_server_died_before_it_spawned_the_process_is_marked_failed(
    instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    """The daemon's process group killed -9 mid-launch: the run is STARTING with no pid, and
    the code server its `.dagster/grpc_info` tag names refuses connections (its socket file
    left behind). Failed once UNSTARTED_GRACE has passed since the launch, not before, and
    not run monitoring's 180 s later; a run whose server answers is left to start."""
    dead, live = str(tmp_path / "dead.sock"), str(tmp_path / "live.sock")
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(dead)  # the file stays; nothing listens
    server = socket.socket(socket.AF_UNIX)
    server.bind(live)
    server.listen()
    try:
        orphan, launched = launched_run(
            instance, {GRPC_INFO_TAG: _grpc_info(socket=dead), CHANNEL_TAG: "dml_0"}
        )
        slow, _ = launched_run(instance, {GRPC_INFO_TAG: _grpc_info(socket=live), CHANNEL_TAG: "dml_1"})
        unnamed, _ = launched_run(instance, {CHANNEL_TAG: "dml_2"})

        assert fail_orphaned_runs(instance, now=launched + UNSTARTED_GRACE - 1) == []
        assert fail_orphaned_runs(instance, now=launched + UNSTARTED_GRACE + 1) == [orphan.run_id]
        failed = instance.get_run_by_id(orphan.run_id)
        assert failed is not None and failed.status == dg.DagsterRunStatus.FAILURE
        for run in (slow, unnamed):
            current = instance.get_run_by_id(run.run_id)
            assert current is not None and current.status == dg.DagsterRunStatus.STARTING
        assert busy_channels(instance) == {"dml_1", "dml_2"}
    finally:
        server.close()


def test_a_code_server_on_a_closed_port_is_gone_and_a_tag_that_names_none_is_not() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    on_port = DagsterRun(
        job_name=sync_job.name, tags={GRPC_INFO_TAG: _grpc_info(host="127.0.0.1", port=port)}
    )
    assert launching_server_gone(on_port)
    for tag in ("", "not json", json.dumps({"host": "localhost"}), json.dumps([1])):
        assert not launching_server_gone(DagsterRun(job_name=sync_job.name, tags={GRPC_INFO_TAG: tag}))


def _grpc_info(**server: str | int) -> str:
    """The `.dagster/grpc_info` tag Dagster's default run launcher puts on a run it launches."""
    return json.dumps({"host": "localhost", **server})
