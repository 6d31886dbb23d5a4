"""The `imported_segments` asset and the import sensor, with Dagster's own `materialize`
and `build_sensor_context` on an ephemeral instance, the import running through Spark
Connect, against a real etcd and real files."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from vchan_assets import imports
from vchan_assets.config import Settings
from vchan_assets.defs.imports.assets import IMPORT_JOBS, import_jobs, import_sensor, imported_segments
from vchan_assets.defs.resources import VchanResource
from vchan_assets.meta.store import MetaStore
from vchan_assets.system import System
from vchan_assets.testing.import_files import assert_imported_once, rows, visible, write_parquet
from vchan_assets.testing.steps import new_collection
from vchan_assets.wal.producer import Producer

from .helpers import sensor_resources


def _materialize(
    instance: dg.DagsterInstance, vchan: VchanResource, job_id: int
) -> dg.ExecuteInProcessResult:
    instance.add_dynamic_partitions(IMPORT_JOBS, [str(job_id)])
    return dg.materialize(
        [imported_segments], instance=instance, resources={"vchan": vchan}, partition_key=str(job_id),
        raise_on_error=False,
    )  # fmt: skip


def test_the_sensor_requests_a_run_per_pending_job_and_the_asset_imports_it_with_passing_checks(
    system: System,
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    producer: Producer,
    tmp_path: Path,
) -> None:
    info = new_collection(producer)
    data = rows(200)
    job_id = imports.submit(
        info.name, [write_parquet(tmp_path / "a.parquet", data)], store=system.store, settings=dsettings
    )

    tick = import_sensor(dg.build_sensor_context(instance=instance, resources=sensor_resources(vchan)))
    assert [r.partition_key for r in tick.run_requests] == [str(job_id)]
    assert tick.dynamic_partitions_requests[0].partition_keys == [str(job_id)]

    result = _materialize(instance, vchan, job_id)

    assert result.success
    [materialization] = result.asset_materializations_for_node("imported_segments")
    assert materialization.metadata["rows"].value == 200
    checks = result.get_asset_check_evaluations()
    assert len(checks) == 2 and all(c.passed for c in checks), [c.description for c in checks]
    assert_imported_once(visible(system, info), data)
    again = import_sensor(dg.build_sensor_context(instance=instance, resources=sensor_resources(vchan)))
    assert not again.run_requests, "a Completed job is not requested again"


def test_the_pk_check_fails_when_an_import_repeats_live_rows(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    tmp_path: Path,
) -> None:
    info = new_collection(producer)
    first = imports.submit(
        info.name, [write_parquet(tmp_path / "a.parquet", rows(50, 0))], store=store, settings=dsettings
    )
    imports.run(first, engine="local", store=store, settings=dsettings)
    second = imports.submit(
        info.name, [write_parquet(tmp_path / "b.parquet", rows(50, 40))], store=store, settings=dsettings
    )

    result = _materialize(instance, vchan, second)

    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert checks["rows_in_files_equal_rows_in_segments"].passed
    pks = checks["no_pk_already_in_collection"]
    assert not pks.passed and pks.metadata["overlap"].value == 10


def test_a_failed_job_fails_the_run_with_its_reason(
    instance: dg.DagsterInstance, vchan: VchanResource, dsettings: Settings, store: MetaStore, producer: Producer,
    tmp_path: Path,
) -> None:  # fmt: skip
    info = new_collection(producer)
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    job_id = imports.submit(info.name, [str(bad)], store=store, settings=dsettings)

    result = _materialize(instance, vchan, job_id)

    assert not result.success
    assert "is not a readable Parquet file" in str(result.failure_data_for_node("imported_segments"))
    assert import_jobs.name == IMPORT_JOBS
