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
    assert set(repository.get_top_level_resources()) == {"vchan", "vchan_env", "pyspark", "teardown"}


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


EXACTLY_ONCE_CHECKS = {
    "binlog_rows_match_log",
    "no_duplicate_pks",
    "binlog_paths_exist",
    "checkpoint_monotonic",
    "sorted_rows_conserved",
    "rows_conserved",
    "no_pk_in_two_live_segments",
    "rows_in_files_equal_rows_in_segments",
    "no_pk_already_in_collection",
}


def test_exactly_once_checks_block_and_derived_assets_are_automated() -> None:
    """The checks that guard exactly once are blocking, the others not; `segment_table` has
    an automation condition, evaluated by `vchan_automation`, and a freshness policy; the
    freshness check of the checkpoints has its sensor."""
    graph = defs.resolve_asset_graph()
    specs = {key.name: graph.get_check_spec(key) for key in graph.asset_check_keys}
    assert {name for name, spec in specs.items() if spec.blocking} == EXACTLY_ONCE_CHECKS
    assert not specs["checkpoints_fresh"].blocking and not specs["builds_finished"].blocking
    automated = {
        key.to_user_string() for key in graph.get_all_asset_keys() if graph.get(key).automation_condition
    }
    assert automated == {"segment_table"}
    assert "checkpoint_freshness_sensor" in {s.name for s in defs.get_repository_def().sensor_defs}
    assert graph.get(dg.AssetKey("segment_table")).freshness_policy is not None
    sensor = defs.get_repository_def().get_sensor_def("vchan_automation")
    assert isinstance(sensor, dg.AutomationConditionSensorDefinition)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING


def test_a_sync_run_evaluates_the_four_checks_of_the_sync_and_not_the_freshness_check() -> None:
    """`checkpoints_fresh` is about every vchannel and has its own sensor: a sync run of one
    vchannel evaluates only the checks its op yields."""
    checks = defs.get_job_def("sync").asset_layer.asset_graph.asset_check_keys
    assert {key.name for key in checks} == {
        "binlog_rows_match_log",
        "no_duplicate_pks",
        "binlog_paths_exist",
        "checkpoint_monotonic",
    }


def test_every_job_runs_its_steps_in_the_run_process_also_the_implicit_asset_job() -> None:
    """The automation sensor's `segment_table` runs (and a materialization launched from the
    UI) use Dagster's implicit asset job: with Dagster's default executor each of its steps
    was a second Python process that imported Dagster and the definitions again (41 s of a
    50 s run of a one-second step, on a loaded machine)."""
    jobs = defs.get_repository_def().get_all_jobs()
    assert "__ASSET_JOB" in {job.name for job in jobs}
    assert {job.name: job.executor_def.name for job in jobs} == {job.name: "in_process" for job in jobs}
