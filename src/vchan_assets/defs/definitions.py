"""The Dagster definitions of vchan_assets (loaded by workspace.yaml).

Wiring only: the assets, job and sensors of each domain (`defs/sync`, `defs/cluster`,
`defs/lifecycle`, `defs/query`, `defs/imports`, `defs/indexes`), the freshness check and its
sensor (`defs/health`), the declarative automation sensor (`defs/automation`) and the
resources (`vchan` for runs, `vchan_env` for sensors: defs/resources.py). The settings are
read once per load.

Every job runs its steps in the run's own process (`in_process_executor`), also the jobs
Dagster makes itself: the implicit asset job of the automation sensor's `segment_table` runs
and of a materialization launched from the UI. Dagster's default executor starts a second
Python process per step, which imports Dagster and these definitions again: for a step of a
second or two, tens of seconds on a loaded machine.
"""

from __future__ import annotations

import dagster as dg

from vchan_assets.config import Settings
from vchan_assets.defs.automation import automation_sensor
from vchan_assets.defs.health import checkpoint_freshness_sensor, checkpoints_fresh
from vchan_assets.defs.imports.assets import import_job, import_sensor, imported_segments
from vchan_assets.defs.indexes.assets import index_job, index_sensor, segment_indexes
from vchan_assets.defs.lifecycle.assets import (
    lifecycle_job,
    lifecycle_sensor,
    segment_lifecycle,
    sort_job,
    sort_sensor,
    sorted_segments,
)
from vchan_assets.defs.query.assets import query_view_job, query_view_sensor, visible_segments
from vchan_assets.defs.resources import VchanEnvResource, VchanResource, pyspark_resource
from vchan_assets.defs.sensors import all_sensors
from vchan_assets.defs.sync.assets import segment_table, sync_vchannel
from vchan_assets.defs.sync.jobs import sync_job
from vchan_assets.defs.sync.loop import AtTeardown, node_sync_loop_job


def build_definitions(settings: Settings) -> dg.Definitions:
    return dg.Definitions(
        assets=[
            sync_vchannel,
            segment_table,
            sorted_segments,
            segment_lifecycle,
            visible_segments,
            imported_segments,
            segment_indexes,
        ],
        asset_checks=[checkpoints_fresh],
        jobs=[sync_job, node_sync_loop_job, lifecycle_job, sort_job, query_view_job, import_job, index_job],
        sensors=[
            *all_sensors(settings.dagster_datanodes),
            lifecycle_sensor,
            sort_sensor,
            query_view_sensor,
            import_sensor,
            index_sensor,
            automation_sensor,
            checkpoint_freshness_sensor,
        ],
        executor=dg.in_process_executor,
        resources={
            "vchan": VchanResource.from_env(),
            "vchan_env": VchanEnvResource(),
            "pyspark": pyspark_resource(settings),
            "teardown": AtTeardown(),
        },
    )


defs = build_definitions(Settings.from_env())
