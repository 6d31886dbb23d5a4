"""The Dagster definitions load (what workspace.yaml points the webserver and daemon at)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import dagster as dg

from vchan_assets.config import Settings
from vchan_assets.defs.definitions import build_definitions, defs


def test_the_definitions_load_with_every_asset_sensor_job_and_resource() -> None:
    dg.Definitions.validate_loadable(defs)
    repository = defs.get_repository_def()

    assets = {key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()}
    assert assets == {
        "binlogs",
        "segments",
        "channel_checkpoints",
        "segment_table",
        "sorted_segments",
        "compacted_segments",
        "garbage_collection",
        "visible_segments",
        "imported_segments",
        "segment_indexes",
    }
    sensors = {s.name for s in repository.sensor_defs}
    assert {
        "datanode_1",
        "sync_sensor",
        "datacoord_sensor",
        "lifecycle_sensor",
        "import_sensor",
        "sort_sensor",
        "query_view_sensor",
        "index_sensor",
    } <= sensors
    assert all(
        repository.has_job(job)
        for job in ("sync", "lifecycle", "bulk_import", "sort", "query_view", "segment_index")
    )
    assert set(repository.get_top_level_resources()) == {"vchan", "pyspark"}


def test_loading_the_definitions_leaves_the_process_environment_alone() -> None:
    probe = (
        "import os; before = dict(os.environ); import vchan_assets.defs.definitions; "
        "changed = sorted(k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k)); "
        "print(changed)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "VCHAN_"))}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_node_slots_come_from_the_settings_of_the_load() -> None:
    few = build_definitions(replace(Settings(), dagster_datanodes=1)).get_repository_def()
    many = build_definitions(replace(Settings(), dagster_datanodes=3)).get_repository_def()

    assert {s.name for s in few.sensor_defs if s.name.startswith("datanode_")} == {"datanode_1"}
    assert {s.name for s in many.sensor_defs if s.name.startswith("datanode_")} == {
        "datanode_1",
        "datanode_2",
        "datanode_3",
    }
