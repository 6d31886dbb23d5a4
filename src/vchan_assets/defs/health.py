"""Health of the vchannels on the asset graph: `checkpoints_fresh`, the freshness check of
`channel_checkpoints`.

It fails (severity ERROR) when a vchannel with log messages to sync has not had its
checkpoint advance past its oldest unsynced batch within VCHAN_CHECKPOINT_FRESHNESS seconds:
its DataNode is gone, stuck, or cannot keep up. A vchannel synced to its head is fresh
however old its checkpoint. A stale channel is one whose syncs stopped, so the check cannot
wait for them: `checkpoint_freshness_sensor` evaluates it every FRESHNESS_INTERVAL seconds
and reports the evaluation from the sensor tick, without a run (one run a minute would be
1,440 run records a day for one number). The check can also be run from the UI (its
`@asset_check`). Its metadata (stale vchannels, the oldest wait) is plotted over time.
"""

from __future__ import annotations

import time

import dagster as dg

from vchan_assets.datanode.checks import CheckOutcome, check_checkpoints_fresh
from vchan_assets.defs.checks import typed
from vchan_assets.defs.resources import OpensSystem, VchanEnvResource, VchanResource
from vchan_assets.defs.sync.assets import CHANNEL_CHECKPOINTS

CHECK_NAME = "checkpoints_fresh"
FRESHNESS_INTERVAL = 60  # seconds between evaluations by the sensor


def freshness(vchan: OpensSystem) -> CheckOutcome:
    """The check's outcome now, over every vchannel of every collection."""
    with vchan.open() as runtime:
        backlogs = [runtime.status(v, info).backlog for v, info in runtime.vchannels().items()]
        limit = runtime.settings.checkpoint_freshness
    return check_checkpoints_fresh(backlogs, limit, time.time())


@dg.asset_check(
    asset=CHANNEL_CHECKPOINTS.key,
    name=CHECK_NAME,
    description="Freshness: no vchannel with log messages to sync waits longer than "
    "VCHAN_CHECKPOINT_FRESHNESS seconds for its checkpoint to advance (evaluated every minute "
    "by checkpoint_freshness_sensor).",
)
def checkpoints_fresh(vchan: VchanResource) -> dg.AssetCheckResult:
    outcome = freshness(vchan)
    return dg.AssetCheckResult(
        passed=outcome.passed,
        description=outcome.description,
        metadata=typed(outcome.metadata),
        severity=dg.AssetCheckSeverity.ERROR,
    )


@dg.sensor(minimum_interval_seconds=FRESHNESS_INTERVAL, default_status=dg.DefaultSensorStatus.RUNNING)
def checkpoint_freshness_sensor(vchan_env: VchanEnvResource) -> dg.SensorResult:
    """Evaluate `checkpoints_fresh` and report it (an asset check evaluation, no run)."""
    outcome = freshness(vchan_env)
    evaluation = dg.AssetCheckEvaluation(
        asset_key=CHANNEL_CHECKPOINTS.key,
        check_name=CHECK_NAME,
        passed=outcome.passed,
        metadata=typed(outcome.metadata),
        severity=dg.AssetCheckSeverity.ERROR,
        description=outcome.description,
    )
    return dg.SensorResult(asset_events=[evaluation])
