"""Health of the vchannels on the asset graph: `checkpoints_fresh`, the freshness check of
`channel_checkpoints`.

It fails (severity ERROR) when a vchannel with log messages to sync has not had its checkpoint
advance past its oldest unsynced batch within VCHAN_CHECKPOINT_FRESHNESS seconds: its
DataNode is gone, stuck, or cannot keep up. A vchannel with nothing to sync is fresh
however old its checkpoint. Declarative automation evaluates it every minute
(defs/automation.py), whatever the syncs do: a stale channel is one whose syncs stopped,
so the check cannot wait for them. The numbers (stale vchannels, the oldest wait) are
its metadata, plotted over time in the UI.
"""

from __future__ import annotations

import time

import dagster as dg

from vchan_assets.datanode.checks import check_checkpoints_fresh
from vchan_assets.defs.automation import freshness_check_condition
from vchan_assets.defs.checks import typed
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.sync.assets import CHANNEL_CHECKPOINTS

CHECK_NAME = "checkpoints_fresh"


@dg.asset_check(
    asset=CHANNEL_CHECKPOINTS.key,
    name=CHECK_NAME,
    description="Freshness: no vchannel with log messages to sync waits longer than VCHAN_CHECKPOINT_FRESHNESS "
    "seconds for its checkpoint to advance (evaluated every minute).",
    automation_condition=freshness_check_condition(),
)
def checkpoints_fresh(vchan: VchanResource) -> dg.AssetCheckResult:
    with vchan.open() as runtime:
        backlogs = [runtime.status(v, info).backlog for v, info in runtime.vchannels().items()]
        limit = runtime.settings.checkpoint_freshness
    outcome = check_checkpoints_fresh(backlogs, limit, time.time())
    return dg.AssetCheckResult(
        passed=outcome.passed,
        description=outcome.description,
        metadata=typed(outcome.metadata),
        severity=dg.AssetCheckSeverity.ERROR,
    )
