"""The Dagster definitions load (what workspace.yaml points the webserver and daemon at)."""

from __future__ import annotations

import dagster as dg

from vchan_assets.defs.definitions import defs


def test_the_definitions_load_with_every_asset_sensor_job_and_resource() -> None:
    dg.Definitions.validate_loadable(defs)
    repository = defs.get_repository_def()

    assets = {key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()}
    assert assets == {"binlogs", "segments", "channel_checkpoints", "segment_catalog"}
    sensors = {s.name for s in repository.sensor_defs}
    assert {"datanode_1", "sync_sensor", "datacoord_sensor"} <= sensors
    assert repository.has_job("sync")
    assert set(repository.get_top_level_resources()) == {"vchan", "pyspark"}
