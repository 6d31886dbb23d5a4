"""The sync job: the three commit-step assets of one vchannel partition, in one process;
and the names the sync loop (sync/loop.py) and the node sensors share.

In-process executor: the three assets are one op anyway, and a step subprocess would
add seconds of start-up to every sync (see BENCHMARKS.md). Every run carries the tag
`vchan/channel`; dagster_home/dagster.yaml admits one run per value at a time.

A sync run evaluates the four checks of the sync itself and no other check of its assets:
`checkpoints_fresh` (defs/health.py) is about every vchannel at once and is evaluated by its
sensor every minute, not by each sync of one vchannel.
"""

from __future__ import annotations

import dagster as dg

from vchan_assets.defs.sync.assets import BINLOGS, CHANNEL_CHECKPOINTS, SEGMENTS, SYNC_CHECKS
from vchan_assets.model import DAGSTER_ADDRESS  # noqa: F401  (where defs import it from)

CHANNEL_TAG = "vchan/channel"
NODE_TAG = "vchan/node"
REASON_TAG = "vchan/reason"
# The long-lived sync loop of a Dagster-hosted node (sync/loop.py): its job, and its tag
# (value: the node id; dagster.yaml admits one run per value).
LOOP_JOB = "datanode_sync_loop"
LOOP_TAG = "vchan/loop"

sync_job = dg.define_asset_job(
    "sync",
    selection=dg.AssetSelection.assets(BINLOGS.key, SEGMENTS.key, CHANNEL_CHECKPOINTS.key).without_checks()
    | dg.AssetSelection.checks(*(c.key for c in SYNC_CHECKS)),
    executor_def=dg.in_process_executor,
    description="Sync one vchannel: binlogs, then segment meta, then the channel checkpoint.",
)
