"""Runs do not pile up: finished runs older than VCHAN_DAGSTER_RETENTION_DAYS are deleted.

Deleting a run deletes its event log, and with it the materializations and check results
it reported: the asset history (the Plots of `binlogs`, `segments`, `channel_checkpoints`)
reaches back `VCHAN_DAGSTER_RETENTION_DAYS`, as far as the runs do. With the sync loops
(defs/sync/loop.py) a node leaves one run per VCHAN_DAGSTER_SYNC_LOOP seconds, so a day is
24 runs per node at the default, not one run per sync. Sensor ticks are pruned by the
daemon itself, after the days in dagster.yaml's `retention:` section.

Only finished runs go (success, failure, canceled): a loop run in flight is never
touched. The sensor deletes at most `PRUNE_BATCH` runs per tick, oldest first, so a
first tick on a large instance does not hold the daemon for minutes.
"""

from __future__ import annotations

import datetime
import logging
import time

import dagster as dg

from vchan_assets.defs.resources import VchanEnvResource

log = logging.getLogger(__name__)

RETENTION_SENSOR_INTERVAL = 600  # seconds
PRUNE_BATCH = 500
FINISHED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
DAY = 86400.0


def prune_runs(instance: dg.DagsterInstance, before: float, limit: int = PRUNE_BATCH) -> list[str]:
    """Delete up to `limit` finished runs last updated before the time `before` (seconds
    since the epoch), with their event logs; their run ids, oldest first."""
    records = instance.get_run_records(
        dg.RunsFilter(
            statuses=FINISHED, updated_before=datetime.datetime.fromtimestamp(before, tz=datetime.UTC)
        ),
        limit=limit,
        ascending=True,
    )
    deleted = []
    for record in records:
        instance.delete_run(record.dagster_run.run_id)
        deleted.append(record.dagster_run.run_id)
    return deleted


@dg.sensor(minimum_interval_seconds=RETENTION_SENSOR_INTERVAL, default_status=dg.DefaultSensorStatus.RUNNING)
def retention_sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SkipReason:
    """Delete finished runs (and their event logs) older than VCHAN_DAGSTER_RETENTION_DAYS."""
    days = vchan_env.settings().dagster_retention_days
    deleted = prune_runs(context.instance, time.time() - days * DAY)
    if deleted:
        log.info("deleted %d runs older than %s days", len(deleted), days)
        return dg.SkipReason(f"deleted {len(deleted)} finished run(s) older than {days:g} days")
    return dg.SkipReason(f"no finished run older than {days:g} days")
