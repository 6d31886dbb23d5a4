"""The SQLite storage of a `vchan up` Dagster instance: Dagster's own, opened for less CPU.

Dagster's code server opens the instance again for every sensor evaluation that has
resources, as do `vchan` commands and notebooks that read it. Dagster's SQLite storage
checks on every opening that its run and schedule databases exist and carry an Alembic
revision, and to learn the newest revision it loads every migration script Dagster ships
(some 90 Python files, twice): about 50 ms of CPU an opening against 2 ms for a query
(BENCHMARKS.md, `bench.instance_open`). Four sensors tick every second.

`SqliteStorage` is `DagsterSqliteStorage` with the same files under the same `base_dir`
(the instance's DAGSTER_HOME) and the same tables. Its first opening in a process makes
Dagster's checks (and creates and stamps the databases when they are new); later openings
of the same `base_dir` in that process connect without them: the migration scripts a
process loaded do not change under it. The event log's databases (its index, and one per
run), which Dagster checks at each storage's first connection to them, are checked at the
process's first. `deploy.service.write_instance_config` names it in the `storage:` section
of every SQLite instance it writes.

Between openings, Dagster's SQLite storages spend most of an idle deployment's queries on
two more things, which these keep for the process:
- a new SQLAlchemy engine for every connection (`create_engine`, then the dialect's first
  connection): here one engine per database, still with a new SQLite connection each time
  (`NullPool`, as Dagster's);
- questions about the schema before the query (is there an `instigators` table, do `runs`
  have `start_time` and `end_time` columns: an inspector's PRAGMA each time): here an answer
  found true is kept. Dagster's migrations only add tables and columns, so a true answer
  stays true; a false one is asked again.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as db
from dagster._core.storage.event_log import SqliteEventLogStorage
from dagster._core.storage.event_log.sqlite.sqlite_event_log import (
    INDEX_SHARD_NAME,
    SQLITE_BUSY_TIMEOUT_SECONDS,
)
from dagster._core.storage.runs import SqliteRunStorage
from dagster._core.storage.schedules import SqliteScheduleStorage
from dagster._core.storage.sqlite import create_db_conn_string
from dagster._core.storage.sqlite_storage import (
    DagsterSqliteStorage,
    _event_logs_directory,
    _runs_directory,
    _schedule_directory,
)
from dagster._serdes import ConfigurableClassData
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

# The base directories this process opened through Dagster's checks.
_checked: set[str] = set()
_lock = threading.Lock()
# This process's engine of each database, by connection string.
_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()  # not _lock: the first opening makes engines while it holds that
# The event log databases (index, run ids) checked in this process, by event log directory.
_event_dbs: dict[str, set[str]] = {}
# (connection string, question) of the schema questions answered true in this process.
_known_true: set[tuple[str, str]] = set()


def _engine(conn_string: str, **connect_args: Any) -> Engine:
    if (engine := _engines.get(conn_string)) is None:
        with _engines_lock:
            engine = _engines.setdefault(
                conn_string, db.create_engine(conn_string, poolclass=NullPool, connect_args=connect_args)
            )
    return engine


def _known(conn_string: str, question: str, ask: Callable[[], bool]) -> bool:
    """`ask()`, unless it answered true in this process before."""
    if (conn_string, question) in _known_true:
        return True
    answer = ask()
    if answer:
        _known_true.add((conn_string, question))
    return answer


class _KeptEngine:
    """`connect` on the process's engine of the database (module docstring)."""

    _conn_string: str

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        with _engine(self._conn_string).connect() as conn, conn.begin():
            yield conn


class RunStorage(_KeptEngine, SqliteRunStorage):
    """Dagster's SQLite run storage, its engine and its true schema answers kept."""

    def has_run_stats_index_cols(self) -> bool:
        return _known(self._conn_string, "run_stats_index_cols", super().has_run_stats_index_cols)

    def has_bulk_actions_selector_cols(self) -> bool:
        return _known(self._conn_string, "bulk_actions_selector_cols", super().has_bulk_actions_selector_cols)

    def has_backfill_id_column(self) -> bool:
        return _known(self._conn_string, "backfill_id_column", super().has_backfill_id_column)

    def has_bulk_action_job_name_column(self) -> bool:
        return _known(
            self._conn_string, "bulk_action_job_name_column", super().has_bulk_action_job_name_column
        )

    def has_backfill_tags_table(self) -> bool:
        return _known(self._conn_string, "backfill_tags_table", super().has_backfill_tags_table)


class ScheduleStorage(_KeptEngine, SqliteScheduleStorage):
    """Dagster's SQLite schedule storage (sensor ticks and states), its engine and its true
    schema answers kept."""

    def _has_instigators_table(self, conn: Connection) -> bool:
        return _known(
            self._conn_string,
            "instigators_table",
            lambda: super(ScheduleStorage, self)._has_instigators_table(conn),
        )

    def _has_asset_daemon_asset_evaluations_table(self, conn: Connection) -> bool:
        ask = super()._has_asset_daemon_asset_evaluations_table
        return _known(self._conn_string, "asset_daemon_asset_evaluations_table", lambda: ask(conn))

    def has_secondary_index_table(self) -> bool:
        return _known(self._conn_string, "secondary_index_table", super().has_secondary_index_table)


class EventLogStorage(SqliteEventLogStorage):
    """Dagster's SQLite event log storage: an index database (asset and dynamic partition
    tables) and one database per run. Dagster checks a database's Alembic revision at a
    storage's first connection to it; here at the process's first, as the storages of one
    `base_dir` share the set of the databases checked. The index database's engine is kept.
    """

    def __init__(self, base_dir: str) -> None:
        super().__init__(base_dir)
        self._initialized_dbs = _event_dbs.setdefault(self._base_dir, set())

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Connection]:
        """The index database on the process's engine of it; a run's database as Dagster
        connects to it (one engine each time: there is one database per run)."""
        if shard != INDEX_SHARD_NAME or shard not in self._initialized_dbs:
            with super()._connect(shard) as conn:
                yield conn
            return
        engine = _engine(self.conn_string_for_shard(shard), timeout=SQLITE_BUSY_TIMEOUT_SECONDS)
        with self._db_lock, engine.connect() as conn, conn.begin():
            yield conn

    def has_table(self, table_name: str) -> bool:
        """Whether the index database has the table (asked before each dynamic partitions
        query)."""
        return _known(
            self.conn_string_for_shard(INDEX_SHARD_NAME),
            f"table {table_name}",
            lambda: super(EventLogStorage, self).has_table(table_name),
        )

    def wipe(self) -> None:
        """Dagster's wipe deletes the runs' databases: none of them is checked any more."""
        super().wipe()
        _event_dbs[self._base_dir].clear()
        self._initialized_dbs = _event_dbs[self._base_dir]


class SqliteStorage(DagsterSqliteStorage):
    """Dagster's SQLite storage, whose databases are checked once per process (module
    docstring)."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        # What DagsterSqliteStorage.__init__ builds, with the storages above; the checks of
        # Dagster's `from_local` at the first opening of `base_dir` in this process only.
        self.base_dir = base_dir
        self._event_log_storage = EventLogStorage(_event_logs_directory(base_dir))
        key = os.path.realpath(base_dir)
        with _lock:
            first = key not in _checked
            if first:
                self._run_storage = RunStorage.from_local(_runs_directory(base_dir))
                self._schedule_storage = ScheduleStorage.from_local(_schedule_directory(base_dir))
                _checked.add(key)
        if not first:
            self._run_storage = RunStorage(create_db_conn_string(_runs_directory(base_dir), "runs"))
            self._schedule_storage = ScheduleStorage(
                create_db_conn_string(_schedule_directory(base_dir), "schedules")
            )
        self._inst_data = inst_data
        super(DagsterSqliteStorage, self).__init__()  # what DagsterSqliteStorage.__init__ ends with

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Any) -> SqliteStorage:
        return cls.from_local(inst_data=inst_data, **config_value)
