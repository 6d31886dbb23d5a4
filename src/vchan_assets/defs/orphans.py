"""Runs whose worker process died are marked failed, so they stop holding their vchannel.

Dagster's default run launcher starts each run in a process of the code server; when that
process dies without reporting (kill -9 of the daemon's process group, OOM, a machine
reboot) the run stays STARTING or STARTED forever. Here that is not cosmetic: the queued run
coordinator admits one run per `vchan/channel` tag and the sync sensor skips a channel with
a run in flight, so one orphaned run stops its channel from ever syncing again. Dagster's
run monitoring only checks worker health for launchers that support it (Kubernetes,
Docker, ECS), not for the default launcher, so this sensor does it for runs on this host:
a STARTING or STARTED run whose process (the pid of its "Started process for run" engine
event) is gone is reported failed. (A run killed before its process even started has no
pid: run monitoring's start timeout in dagster.yaml, 180 s, fails it.) The work it did is
safe either way: a sync either committed its etcd transaction or left nothing, and the
sensor that requested it asks again (a retry run key).
"""

from __future__ import annotations

import logging

import dagster as dg
from dagster._core.events import DagsterEventType

from vchan_assets.meta.embedded import pid_alive

log = logging.getLogger(__name__)

ORPHAN_SENSOR_INTERVAL = 5
# A run's process reports its pid while STARTING, then RUN_START makes it STARTED.
IN_PROCESS = (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)


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


def fail_orphaned_runs(instance: dg.DagsterInstance) -> list[str]:
    """Report every STARTING or STARTED run whose worker process is gone as failed; their
    run ids."""
    failed = []
    for record in instance.get_run_records(dg.RunsFilter(statuses=list(IN_PROCESS))):
        run = record.dagster_run
        pid = run_worker_pid(instance, run.run_id)
        if pid is None or pid_alive(pid):
            continue
        # Read again: the worker may have reported its end between the two reads.
        current = instance.get_run_by_id(run.run_id)
        if current is None or current.status not in IN_PROCESS:
            continue
        message = (
            f"The run's worker process (pid {pid}) is gone without reporting an end "
            "(killed, out of memory, or its daemon's process group was killed): marked failed "
            "so its vchannel is free again; the sensor that requested it asks for a new run."
        )
        instance.report_run_failed(current, message)
        log.warning("run %s of %s: %s", run.run_id, run.job_name, message)
        failed.append(run.run_id)
    return failed


@dg.sensor(minimum_interval_seconds=ORPHAN_SENSOR_INTERVAL, default_status=dg.DefaultSensorStatus.RUNNING)
def orphaned_runs_sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    """Mark runs whose worker process died as failed (they held their vchannel forever)."""
    failed = fail_orphaned_runs(context.instance)
    if failed:
        return dg.SkipReason(f"marked {len(failed)} orphaned run(s) failed: {', '.join(failed)}")
    return dg.SkipReason("no orphaned runs")
