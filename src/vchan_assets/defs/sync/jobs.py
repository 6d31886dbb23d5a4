"""The sync job: the three commit-step assets of one vchannel partition, in one process.

In-process executor: the three assets are one op anyway, and a step subprocess would
add seconds of start-up to every sync (see BENCHMARKS.md). Every run carries the tag
`vchan/channel`; dagster_home/dagster.yaml admits one run per value at a time.
"""

from __future__ import annotations

import dagster as dg

from vchan_assets.defs.sync.assets import BINLOGS, CHANNEL_CHECKPOINTS, SEGMENTS

CHANNEL_TAG = "vchan/channel"
NODE_TAG = "vchan/node"
REASON_TAG = "vchan/reason"

sync_job = dg.define_asset_job(
    "sync",
    selection=dg.AssetSelection.assets(BINLOGS.key, SEGMENTS.key, CHANNEL_CHECKPOINTS.key),
    executor_def=dg.in_process_executor,
    description="Sync one vchannel: binlogs, then segment meta, then the channel checkpoint.",
)
