"""The SQLite storage `vchan up` instances use (defs/instance_storage.py): Dagster's files,
checked once per process."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.runs.sqlite import sqlite_run_storage
from dagster._core.storage.schedules.sqlite import sqlite_schedule_storage
from dagster._core.storage.sqlite_storage import DagsterSqliteStorage

from vchan_assets.defs.instance_storage import SqliteStorage
from vchan_assets.deploy.service import INSTANCE_CONFIG, local_storage, write_instance_config
from vchan_assets.testing.dagster_jobs import one_op


def _instance(home: Path) -> dg.DagsterInstance:
    """The instance as Dagster's code server opens it for a sensor's evaluation."""
    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


@pytest.fixture
def schema_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The databases whose Alembic revision Dagster's storages check, in order."""
    checked: list[str] = []
    for module, name in ((sqlite_run_storage, "runs"), (sqlite_schedule_storage, "schedules")):
        check = module.check_alembic_revision

        def counted(config, connection, check=check, name=name):  # type: ignore[no-untyped-def]
            checked.append(name)
            return check(config, connection)

        monkeypatch.setattr(module, "check_alembic_revision", counted)
    return checked


def test_the_instance_config_names_the_storage_on_the_instance_home(tmp_path: Path) -> None:
    config = write_instance_config(tmp_path).read_text()
    assert config.startswith(INSTANCE_CONFIG.read_text())
    assert yaml.safe_load(config)["storage"] == local_storage(tmp_path)
    with _instance(tmp_path) as instance:
        assert isinstance(instance.get_ref().storage, SqliteStorage)


def test_a_second_opening_skips_the_checks_and_shares_dagsters_files(
    tmp_path: Path, schema_checks: list[str]
) -> None:
    home = tmp_path / "instance"
    write_instance_config(home)
    with _instance(home) as first:
        assert schema_checks == ["runs", "schedules"]  # created and stamped
        done = one_op.execute_in_process(instance=first)
        assert done.success
    with _instance(home) as second:
        assert schema_checks == ["runs", "schedules"]  # none again
        assert second.get_run_by_id(done.run_id).is_success
        events = [e.dagster_event_type for e in second.all_logs(done.run_id)]
        assert events[-1] == dg.DagsterEventType.RUN_SUCCESS
        second.add_dynamic_partitions("vchannels", ["v0"])  # the run and schedule tables
        assert second.get_dynamic_partitions("vchannels") == ["v0"]
    # Dagster's own storage on the same directory reads what this one wrote, and this one
    # what Dagster's wrote.
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home), config_filename="none.yaml")) as plain:
        assert type(plain.get_ref().storage) is DagsterSqliteStorage
        assert plain.get_run_by_id(done.run_id).is_success
        again = one_op.execute_in_process(instance=plain)
    with _instance(home) as third:
        assert {r.run_id for r in third.get_runs()} == {done.run_id, again.run_id}


def test_a_new_home_in_the_same_process_gets_its_databases_created(
    tmp_path: Path, schema_checks: list[str]
) -> None:
    for home in (tmp_path / "a", tmp_path / "b"):
        write_instance_config(home)
        with _instance(home) as instance:
            assert one_op.execute_in_process(instance=instance).success
            assert len(instance.get_runs()) == 1
    assert schema_checks == ["runs", "schedules", "runs", "schedules"]
