"""The DataCoord sensor: node sessions appear/disappear -> assign/reassign channels;
ToWatch/ToRelease stuck past the watch timeout -> reassign.

Each tick is one `ChannelManager.reconcile(now)` step (the coordinator's single step, which
keeps no state of its own and writes only by compare-version-and-swap, so a tick
re-evaluated after a crash, or a standalone `vchan datacoord` running at the same time,
makes a step skip instead of clobbering). The cursor records the live nodes and the
assignment it last saw, for the UI; it decides nothing.
"""

from __future__ import annotations

import json

import dagster as dg

from vchan_assets.datacoord.channel_manager import ChannelManager, ReconcileReport
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.runtime import VchanRuntime

COORDINATOR_SENSOR_INTERVAL = 1


def coordinate(runtime: VchanRuntime, now: float | None = None) -> ReconcileReport:
    return ChannelManager(runtime.store, runtime.settings).reconcile(now)


def describe(report: ReconcileReport) -> str:
    parts = [f"live nodes {list(report.live_nodes)}"]
    parts += [f"assigned {v} -> {n}" for v, n in report.assigned]
    parts += [f"releasing {v} on {n} ({why})" for v, n, why in report.releasing]
    parts += [f"removed {v} on {n} ({why})" for v, n, why in report.removed]
    parts += [f"waiting: {v}" for v in report.remaining]
    return "; ".join(parts)


@dg.sensor(
    minimum_interval_seconds=COORDINATOR_SENSOR_INTERVAL,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
def datacoord_sensor(context: dg.SensorEvaluationContext, vchan: VchanResource) -> dg.SensorResult:
    """DataCoord: assign channels to live DataNodes, reassign those of dead nodes."""
    with vchan.open() as runtime:
        report = coordinate(runtime)
    if report.changed:
        context.log.info(describe(report))
    cursor = json.dumps({"live_nodes": list(report.live_nodes)})
    return dg.SensorResult(cursor=cursor, skip_reason=describe(report))
