"""The SQLite storage `vchan up` instances use (defs/instance_storage.py): Dagster's files,
checked once per process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy
import yaml
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.event_log.sqlite import sqlite_event_log
from dagster._core.storage.runs.sqlite import sqlite_run_storage
from dagster._core.storage.schedules.sqlite import sqlite_schedule_storage
from dagster._core.storage.sqlite_storage import DagsterSqliteStorage
from sqlalchemy.engine import Engine

from vchan_assets.defs.instance_storage import SqliteStorage
from vchan_assets.defs.sync.sensor import busy_channels
from vchan_assets.deploy.service import INSTANCE_CONFIG, local_storage, write_instance_config
from vchan_assets.testing.dagster_jobs import one_op


def _instance(home: Path) -> dg.DagsterInstance:
    """The instance as Dagster's code server opens it for a sensor's evaluation."""
    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


@pytest.fixture
def schema_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The databases whose Alembic revision Dagster's storages check, in order."""
    checked: list[str] = []
    for module, name in (
        (sqlite_run_storage, "runs"),
        (sqlite_schedule_storage, "schedules"),
        (sqlite_event_log, "event log"),
    ):
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
        assert {"runs", "schedules"} <= set(schema_checks)  # created and stamped
        done = one_op.execute_in_process(instance=first)
        assert done.success
    # and the event log's: its index, then the run's own database
    created = list(schema_checks)
    assert set(created) == {"runs", "schedules", "event log"}
    with _instance(home) as second:
        assert schema_checks == created  # none again
        assert second.get_run_by_id(done.run_id).is_success
        events = [e.dagster_event_type for e in second.all_logs(done.run_id)]
        assert events[-1] == dg.DagsterEventType.RUN_SUCCESS
        second.add_dynamic_partitions("vchannels", ["v0"])  # the run and schedule tables
        assert second.get_dynamic_partitions("vchannels") == ["v0"]
        assert schema_checks == created  # the event log's index neither
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
    assert len(schema_checks) % 2 == 0
    assert schema_checks[: len(schema_checks) // 2] == schema_checks[len(schema_checks) // 2 :]
    assert set(schema_checks) == {"runs", "schedules", "event log"}


def _tick(instance: dg.DagsterInstance) -> None:
    """What the sensors of an idle deployment ask the instance at each tick."""
    busy_channels(instance)
    instance.all_instigator_state()
    instance.get_dynamic_partitions("vchannels")


def test_later_openings_make_no_engine_and_inspect_no_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dagster's SQLite storages made a SQLAlchemy engine for every connection and inspected
    the schema (is there an `instigators` table, do `runs` have `start_time`) before most
    queries: most of an idle deployment's CPU in its daemon and code server. Here only the
    first opening of the instance in the process does."""
    home = tmp_path / "instance"
    write_instance_config(home)
    with _instance(home) as first:
        _tick(first)
    engines: list[object] = []
    inspected: list[object] = []
    inspect = sqlalchemy.inspect

    def counted(subject: object) -> object:
        inspected.append(subject)
        return inspect(subject)

    engine = Engine.__init__

    def made(self: Engine, *args: Any, **kwargs: Any) -> None:
        engines.append(args)
        engine(self, *args, **kwargs)

    monkeypatch.setattr(sqlalchemy, "inspect", counted)
    monkeypatch.setattr(Engine, "__init__", made)
    for _ in range(3):
        with _instance(home) as later:
            _tick(later)
            later.add_dynamic_partitions("vchannels", ["v0"])
            assert later.get_dynamic_partitions("vchannels") == ["v0"]
    assert engines == [] and inspected == []


def test_after_a_wipe_runs_and_their_events_are_stored_again(tmp_path: Path) -> None:
    """Dagster's `wipe` deletes every run's database: the databases this process checked are
    forgotten, so a run after it gets its database created again, in every opening."""
    home = tmp_path / "instance"
    write_instance_config(home)
    with _instance(home) as first:
        before = one_op.execute_in_process(instance=first)
        first.wipe()
        assert first.get_runs() == []
        after = one_op.execute_in_process(instance=first)
    with _instance(home) as later:
        assert [r.run_id for r in later.get_runs()] == [after.run_id]
        assert later.all_logs(after.run_id)[-1].dagster_event_type == dg.DagsterEventType.RUN_SUCCESS
        assert later.all_logs(before.run_id) == []
