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
process loaded do not change under it. `deploy.service.write_instance_config` names it in
the `storage:` section of every SQLite instance it writes.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from dagster._core.storage.event_log import SqliteEventLogStorage
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

# The base directories this process opened through Dagster's checks.
_checked: set[str] = set()
_lock = threading.Lock()


class SqliteStorage(DagsterSqliteStorage):
    """Dagster's SQLite storage, whose databases are checked once per process (module
    docstring)."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        key = os.path.realpath(base_dir)
        with _lock:
            if key not in _checked:
                super().__init__(base_dir, inst_data)
                _checked.add(key)
                return
        # What DagsterSqliteStorage.__init__ builds, without the checks of each from_local.
        self.base_dir = base_dir
        self._run_storage = SqliteRunStorage(create_db_conn_string(_runs_directory(base_dir), "runs"))
        self._event_log_storage = SqliteEventLogStorage(_event_logs_directory(base_dir))
        self._schedule_storage = SqliteScheduleStorage(
            create_db_conn_string(_schedule_directory(base_dir), "schedules")
        )
        self._inst_data = inst_data
        super(DagsterSqliteStorage, self).__init__()  # what DagsterSqliteStorage.__init__ ends with

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Any) -> SqliteStorage:
        return cls.from_local(inst_data=inst_data, **config_value)
