"""Every sensor: one DataNode watch sensor per configured node slot, the sync sensor,
and the DataCoord sensor.

Node slots: VCHAN_DAGSTER_DATANODES (default 2) slots named 1..N, read when the
definitions load.
"""

from __future__ import annotations

import dagster as dg

from vchan_assets.config import Settings
from vchan_assets.defs.cluster.datacoord import datacoord_sensor
from vchan_assets.defs.cluster.datanodes import datanode_sensor
from vchan_assets.defs.sync.sensor import sync_sensor


def node_slots() -> list[str]:
    return [str(i) for i in range(1, Settings.from_env().dagster_datanodes + 1)]


def all_sensors() -> list[dg.SensorDefinition]:
    return [*(datanode_sensor(slot) for slot in node_slots()), sync_sensor, datacoord_sensor]
