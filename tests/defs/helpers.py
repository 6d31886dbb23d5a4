"""Helpers shared by the Dagster-layer tests: the hosted node sensors and a sensor
evaluation against real etcd through Dagster's own context builder."""

from __future__ import annotations

import dagster as dg

from vchan_assets.defs.cluster.datacoord import datacoord_sensor
from vchan_assets.defs.cluster.datanodes import datanode_sensor
from vchan_assets.defs.resources import VchanResource

NODE1 = datanode_sensor("1", min_session_ttl=0)
NODE2 = datanode_sensor("2", min_session_ttl=0)


def evaluate(
    sensor: dg.SensorDefinition, instance: dg.DagsterInstance, vchan: VchanResource, cursor: str | None = None
) -> dg.SensorResult:
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"vchan": vchan})
    result = sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result


class CoordinatorTicks:
    """The DataCoord sensor evaluated tick after tick, its cursor (the term it holds in
    the election) carried from one tick to the next as the daemon does."""

    def __init__(self, instance: dg.DagsterInstance, vchan: VchanResource) -> None:
        self.instance = instance
        self.vchan = vchan
        self.cursor: str | None = None

    def tick(self) -> dg.SensorResult:
        result = evaluate(datacoord_sensor, self.instance, self.vchan, self.cursor)
        self.cursor = result.cursor
        return result


def skip_message(result: dg.SensorResult) -> str:
    return result.skip_reason.skip_message or "" if result.skip_reason else ""
