"""Declarative automation of the assets that derive from other assets, and the sensor that
evaluates it (`vchan_automation`). Sensors stay where etcd drives the work (node sessions,
channel watch keys, flushed segments waiting for their sort, index builds, import jobs,
the DataCoord election); an asset that is a function of its upstream assets is
materialized by an `AutomationCondition` instead:

- `segment_table` (the catalog table): at once when it is missing (a new stack), after syncs
  (`channel_checkpoints` updated; at most every 2 min), and every CATALOG_REFRESH_CRON so it
  stays fresh on an idle stack; never while a run of it is in flight, nor while a blocking
  (exactly-once) check of its upstream assets failed: a sync whose rows do not match its
  log stops the catalog from publishing it. Its `FreshnessPolicy` (CATALOG_FRESHNESS) shows fresh/stale on the asset graph.

The freshness check of `channel_checkpoints` is evaluated by a sensor of its own, without
runs (defs/health.py).

The sensor evaluates the conditions in the daemon every AUTOMATION_INTERVAL seconds and
launches plain runs (no backfills: the targets are unpartitioned).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import dagster as dg

AUTOMATION_INTERVAL = 10  # seconds between evaluations of the conditions
# After syncs at most every 2 min (syncs come every few seconds: at most 720 runs a day,
# not one per sync), and every 30 min whatever happened (an idle stack's table stays fresh).
CATALOG_AFTER_SYNCS_CRON = "*/2 * * * *"
CATALOG_REFRESH_CRON = "*/30 * * * *"
CATALOG_FRESHNESS = dg.FreshnessPolicy.time_window(
    fail_window=timedelta(minutes=60), warn_window=timedelta(minutes=35)
)


def catalog_condition() -> dg.AutomationCondition:
    """When a catalog table derived from the syncs is materialized (see the module doc):
    while it is missing (once: not again after a failed run, until the next tick below); at
    the first CATALOG_AFTER_SYNCS_CRON tick after a sync updated `channel_checkpoints`; at
    every CATALOG_REFRESH_CRON tick. Never while a run of it is in flight, nor while the
    latest evaluation of a blocking check of an upstream asset failed, in any partition.

    Dagster's `newly_missing()` would not do for the first materialization: an asset missing
    at the condition's first evaluation is never *newly* missing (the first evaluation resets
    `since_last_handled`). Nor would `all_deps_blocking_checks_passed()`: it is false until a
    check has *passed*, so a table missing before the first sync waited for one; the
    condition waits only while a check *failed*, in any vchannel."""
    conditions = dg.AutomationCondition
    sync_tick: dg.AutomationCondition[Any] = conditions.cron_tick_passed(CATALOG_AFTER_SYNCS_CRON)
    refresh_tick: dg.AutomationCondition[Any] = conditions.cron_tick_passed(CATALOG_REFRESH_CRON)
    missing = (conditions.missing() & ~conditions.execution_failed()).with_label("missing")
    after_syncs = sync_tick.since_last_handled() & conditions.any_deps_updated().since_last_handled()
    check_failed = conditions.any_deps_match(
        conditions.any_checks_match(conditions.check_failed(), blocking_only=True)
    ).with_label("a blocking check of a dependency failed")
    return (
        (missing | after_syncs | refresh_tick.since_last_handled())
        & ~conditions.in_progress()
        & ~check_failed
    ).with_label("after syncs (at most every 2 min), every 30 min; exactly-once checks passed")


automation_sensor = dg.AutomationConditionSensorDefinition(
    "vchan_automation",
    target=dg.AssetSelection.all(),
    minimum_interval_seconds=AUTOMATION_INTERVAL,
    default_status=dg.DefaultSensorStatus.RUNNING,
    emit_backfills=False,
    description="Declarative automation: the catalog table after the syncs.",
)
