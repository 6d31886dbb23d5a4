"""Every sensor: one DataNode watch sensor per configured node slot, the sync sensor,
the DataCoord sensor, the sensor that frees the vchannels of runs whose worker died and
the one that deletes finished runs past their retention.

Node slots: VCHAN_DAGSTER_DATANODES (default 2) slots named 1..N, from the settings the
definitions were loaded with.
"""

from __future__ import annotations

import dagster as dg

from vchan_assets.defs.cluster.datacoord import datacoord_sensor
from vchan_assets.defs.cluster.datanodes import datanode_sensor
from vchan_assets.defs.orphans import orphaned_runs_sensor
from vchan_assets.defs.retention import retention_sensor
from vchan_assets.defs.sync.sensor import sync_sensor


def all_sensors(datanodes: int) -> list[dg.SensorDefinition]:
    slots = [str(i) for i in range(1, datanodes + 1)]
    return [
        *(datanode_sensor(slot) for slot in slots),
        sync_sensor,
        datacoord_sensor,
        orphaned_runs_sensor,
        retention_sensor,
    ]
