"""Crash safety: `vchan import --wait` SIGKILLed at each step (the failpoints), then a
restart (the same command again, or the DataCoord's import step taking the stuck job
over) finishes the job: never half visible, never imported twice; the dead attempt's
files are orphans that garbage collection removes."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import list_orphans
from vchan_assets.imports.jobs import ImportState, get_job
from vchan_assets.imports.step import import_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.import_files import (
    assert_imported_once,
    collect_garbage,
    rows,
    run_import,
    vchan_import,
    visible,
    write_parquet,
)
from vchan_assets.testing.steps import new_collection
from vchan_assets.wal.producer import Producer

STEPS = ["import_after_preimport", "import_after_binlogs", "import_before_commit"]


@pytest.mark.parametrize("restart", ["same command", "datacoord step"])
@pytest.mark.parametrize("step", STEPS)
def test_import_killed_at_a_step_then_restarted_imports_exactly_once(
    system: System, step: str, restart: str, store: MetaStore, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    parts = [rows(120, 0, seed=1), rows(80, 1000, seed=2)]
    paths = [write_parquet(tmp_path / f"{i}.parquet", t) for i, t in enumerate(parts)]
    args = ["--collection", info.name, "--job-id", "77", *paths]

    crashed = vchan_import(system.settings, *args, VCHAN_FAILPOINT=step)

    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    job = get_job(store, 77).model
    assert job.state is ImportState.IMPORTING
    assert visible(system, info).num_rows == 0, "nothing visible before the commit"
    importing = [s for s in segments(store, info) if s.state is SegmentState.IMPORTING]
    assert bool(importing) == (step == "import_before_commit") == bool(job.segment_ids)
    if step == "import_after_binlogs":
        assert list_orphans(store, system.storage), "the dead attempt's files are named by no meta"

    if restart == "same command":
        again = vchan_import(system.settings, *args)
        assert again.returncode == 0, again.stderr
    else:
        report = import_step(
            replace(system, settings=replace(system.settings, import_timeout=0.001)), engine="local"
        )
        assert report.resumed == [77] and report.completed == [77]

    assert get_job(store, 77).model.state is ImportState.COMPLETED
    assert_imported_once(visible(system, info), pa.concat_tables(parts))
    assert not [s for s in segments(store, info) if s.state is SegmentState.IMPORTING]
    collect_garbage(store, system.storage, system.settings)
    assert not list_orphans(store, system.storage)
    assert_imported_once(visible(system, info), pa.concat_tables(parts))


def test_a_stuck_job_whose_collection_was_dropped_fails_with_its_segments_dropped(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    path = write_parquet(tmp_path / "a.parquet", rows(50))
    crashed = vchan_import(
        settings, "--collection", info.name, "--job-id", "5", path, VCHAN_FAILPOINT="import_before_commit"
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    producer.drop_collection(info.name)

    report = import_step(System(replace(settings, import_timeout=0.001), store, storage), engine="local")

    job = get_job(store, 5).model
    assert report.failed == [5] and job.state is ImportState.FAILED
    assert "was dropped during the job" in job.reason
    assert {s.state for s in segments(store, info)} == {SegmentState.DROPPED}


def test_a_job_out_of_attempts_fails_instead_of_retrying_forever(
    system: System, store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    path = write_parquet(tmp_path / "a.parquet", rows(50))
    quick = replace(settings, import_timeout=0.001, import_max_attempts=2)
    for _ in range(2):
        crashed = vchan_import(
            settings, "--collection", info.name, "--job-id", "9", path, VCHAN_FAILPOINT="import_after_binlogs"
        )
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr

    report = import_step(System(quick, store, storage), engine="local")

    job = get_job(store, 9).model
    assert report.failed == [9] and job.state is ImportState.FAILED
    assert "after 2 attempts" in job.reason and visible(system, info).num_rows == 0


def test_the_deletes_of_an_upsert_not_yet_committed_apply_to_no_read_and_no_compaction(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    """An upsert import killed before its commit leaves an Importing L0 segment whose delta
    logs delete the pks it replaces. Until the job commits, those deletes must apply to
    nothing: not to a collection read, and not to a sort compaction, which would remove
    the old rows for good even if the import then fails."""
    from vchan_assets.imports.executor import ImportExecutor
    from vchan_assets.lifecycle.step import sort_step

    info = new_collection(producer, channels=1)
    old = rows(50, 0, seed=1)
    run_import(store, settings, info, [write_parquet(tmp_path / "old.parquet", old)])
    new = write_parquet(tmp_path / "new.parquet", rows(50, 40, seed=2))  # pks 40..89
    crashed = vchan_import(
        settings,
        "--collection",
        info.name,
        "--job-id",
        "78",
        "--upsert",
        new,
        VCHAN_FAILPOINT="import_before_commit",
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    pending = [s for s in segments(store, info) if s.state is SegmentState.IMPORTING and s.deltalogs]
    assert pending, "the killed upsert left its deletes in an Importing L0 segment"

    assert_imported_once(visible(system, info), old)
    outcomes = sort_step(system, engine="local")
    assert outcomes and all(o.state.value == "Completed" for o in outcomes), outcomes
    ImportExecutor(system).fail(get_job(store, 78), "given up by the test")
    assert_imported_once(visible(system, info), old)
