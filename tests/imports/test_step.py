"""The DataCoord schedules imports: a `vchan datacoord` process runs a submitted job; one
SIGKILLed in the middle of a job is replaced by another that takes the stuck job over."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from vchan_assets import imports
from vchan_assets.config import Settings
from vchan_assets.imports.jobs import ImportState, get_job
from vchan_assets.meta.store import MetaStore
from vchan_assets.system import System
from vchan_assets.testing.harness import Role, cli_env
from vchan_assets.testing.import_files import assert_imported_once, rows, visible, write_parquet
from vchan_assets.testing.steps import new_collection
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer


@pytest.fixture
def roles() -> Iterator[list[Role]]:
    started: list[Role] = []
    yield started
    for role in started:
        role.cleanup()


def datacoord(settings: Settings, tmp: Path, roles: list[Role], **env: str) -> Role:
    env = {"VCHAN_IMPORT_INTERVAL": "0.2", "VCHAN_SESSION_TTL": "2", **env}
    role = Role(
        ["datacoord", "--interval", "0.2", "--engine", "local"],
        cli_env(settings, **env),
        tmp / f"datacoord{len(roles)}.log",
    )
    roles.append(role)
    return role


def test_the_datacoord_runs_a_submitted_job(
    system: System, settings: Settings, producer: Producer, tmp_path: Path, roles: list[Role]
) -> None:
    info = new_collection(producer)
    data = rows(100)
    datacoord(settings, tmp_path, roles)

    job_id = imports.submit(
        info.name, [write_parquet(tmp_path / "a.parquet", data)], store=system.store, settings=settings
    )

    job = imports.wait(job_id, timeout=60, store=system.store, settings=settings)
    assert job.state is ImportState.COMPLETED, job.reason
    assert_imported_once(visible(system, info), data)


def test_a_datacoord_killed_mid_job_is_replaced_and_the_job_finishes_once(
    system: System, store: MetaStore, producer: Producer, tmp_path: Path, roles: list[Role]
) -> None:
    info = new_collection(producer)
    data = rows(100)
    first = datacoord(system.settings, tmp_path, roles, VCHAN_FAILPOINT="import_after_binlogs")
    job_id = imports.submit(
        info.name, [write_parquet(tmp_path / "a.parquet", data)], store=store, settings=system.settings
    )

    assert first.process.wait(60) == -signal.SIGKILL
    assert get_job(store, job_id).model.state is ImportState.IMPORTING
    datacoord(system.settings, tmp_path, roles, VCHAN_IMPORT_TIMEOUT="1")

    wait_until(lambda: get_job(store, job_id).model.done, 60, "the stuck job taken over")
    job = get_job(store, job_id).model
    assert job.state is ImportState.COMPLETED and job.attempt == 2, job.reason
    assert_imported_once(visible(system, info), data)
