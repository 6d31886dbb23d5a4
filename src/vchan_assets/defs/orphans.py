"""Runs whose worker process died, or will never start, are marked failed, so they stop
holding their vchannel.

Dagster's default run launcher starts each run in a process of the code server; when that
process dies without reporting (kill -9 of the daemon's process group, OOM, a machine
reboot) the run stays STARTING or STARTED forever. Here that is not cosmetic: the queued run
coordinator admits one run per `vchan/channel` tag and the sync sensor skips a channel with
a run in flight, so one orphaned run stops its channel from ever syncing again. Dagster's
run monitoring only checks worker health for launchers that support it (Kubernetes,
Docker, ECS), not for the default launcher, so this sensor does it for runs on this host:
a STARTING or STARTED run whose process (the pid of its "Started process for run" engine
event) is gone is reported failed. A STARTING run with no pid yet is failed when the code
server that was asked to start its process (the run's `.dagster/grpc_info` tag) no longer
accepts connections `UNSTARTED_GRACE` seconds after the launch: killed with the daemon
before it spawned the process. (Run monitoring's start timeout in dagster.yaml, 180 s, is
the backstop for what this cannot see.) The work such a run did is safe either way: a sync
either committed its etcd transaction or left nothing, and the sensor that requested it
asks again (a retry run key).
"""

from __future__ import annotations

import json
import logging
import socket
import time

import dagster as dg
from dagster._core.events import DagsterEventType
from dagster._core.storage.tags import GRPC_INFO_TAG

from vchan_assets.meta.embedded import pid_alive

log = logging.getLogger(__name__)

ORPHAN_SENSOR_INTERVAL = 5
# A run's process reports its pid while STARTING, then RUN_START makes it STARTED.
IN_PROCESS = (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)
# Seconds after its launch before a STARTING run with no pid is judged by its code server:
# the server spawns the process at once, and the process reports its pid within seconds
# even on a loaded machine; a server killed mid-launch never will.
UNSTARTED_GRACE = 30.0


def run_worker_pid(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """The pid the run's worker process reported when it started, or None before that."""
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        event = entry.dagster_event
        data = event.engine_event_data if event is not None else None
        pid = data.metadata.get("pid") if data is not None else None
        text = str(pid.value) if pid is not None else ""
        if text.isdigit():
            return int(text)
    return None


def launching_server_gone(run: dg.DagsterRun) -> bool:
    """Whether the code server that was asked to start the run's process refuses
    connections (its socket or port); False when the run names none or it cannot tell."""
    try:
        info = json.loads(run.tags.get(GRPC_INFO_TAG, ""))
    except ValueError:
        return False
    if not isinstance(info, dict):
        return False
    if isinstance(info.get("socket"), str):
        family, address = socket.AF_UNIX, info["socket"]
    elif isinstance(info.get("port"), int):
        family, address = socket.AF_INET, (str(info.get("host", "localhost")), info["port"])
    else:
        return False
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(2.0)
            probe.connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        return True
    except OSError:
        return False  # a timeout or an unknown host: not proof that it is gone
    return False


def _never_to_start(instance: dg.DagsterInstance, run: dg.DagsterRun, now: float) -> bool:
    """A STARTING run with no pid, launched over UNSTARTED_GRACE ago by a server now gone."""
    if run.status != dg.DagsterRunStatus.STARTING:
        return False
    launched = instance.get_run_stats(run.run_id).launch_time
    return launched is not None and now - launched >= UNSTARTED_GRACE and launching_server_gone(run)


def _why_orphaned(instance: dg.DagsterInstance, run: dg.DagsterRun, now: float) -> str | None:
    """Why the run will never report its end, or None while it may."""
    pid = run_worker_pid(instance, run.run_id)
    if pid is None:
        if _never_to_start(instance, run, now):
            return (
                "The run's process never started: the code server asked to start it is gone "
                "(killed with its daemon mid-launch)"
            )
        return None
    if pid_alive(pid):
        return None
    return (
        f"The run's worker process (pid {pid}) is gone without reporting an end "
        "(killed, out of memory, or its daemon's process group was killed)"
    )


def fail_orphaned_runs(instance: dg.DagsterInstance, now: float | None = None) -> list[str]:
    """Report every STARTING or STARTED run whose worker process is gone, or will never
    start, as failed; their run ids."""
    now = time.time() if now is None else now
    failed = []
    for record in instance.get_run_records(dg.RunsFilter(statuses=list(IN_PROCESS))):
        run = record.dagster_run
        why = _why_orphaned(instance, run, now)
        if why is None:
            continue
        # Read again: the worker may have reported its end between the two reads.
        current = instance.get_run_by_id(run.run_id)
        if current is None or current.status not in IN_PROCESS:
            continue
        message = f"{why}: marked failed so its vchannel is free; the sensor that requested it asks again."
        instance.report_run_failed(current, message)
        log.warning("run %s of %s: %s", run.run_id, run.job_name, message)
        failed.append(run.run_id)
    return failed


@dg.sensor(minimum_interval_seconds=ORPHAN_SENSOR_INTERVAL, default_status=dg.DefaultSensorStatus.RUNNING)
def orphaned_runs_sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    """Mark runs whose worker process died, or will never start, as failed (they held their
    vchannel forever)."""
    failed = fail_orphaned_runs(context.instance)
    if failed:
        return dg.SkipReason(f"marked {len(failed)} orphaned run(s) failed: {', '.join(failed)}")
    return dg.SkipReason("no orphaned runs")
