"""Bad input fails the job with a reason naming the file (and the column at fault), and
leaves nothing visible: no segment but Dropped ones, no rows for a reader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from vchan_assets.config import Settings
from vchan_assets.imports.jobs import ImportJob, ImportState
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, segments
from vchan_assets.testing.import_files import (
    assert_imported_once,
    assert_nothing_visible,
    rows,
    run_import,
    visible,
    write_parquet,
)
from vchan_assets.testing.steps import new_collection
from vchan_assets.wal.producer import Producer


def _with(table: pa.Table, name: str, column: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, column)


def _not_parquet(tmp: Path) -> str:
    (tmp / "x.parquet").write_text("id,vec\n1,2\n")
    return str(tmp / "x.parquet")


def _truncated(tmp: Path) -> str:
    path = write_parquet(tmp / "t.parquet", rows(100))
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    return path


def _empty(tmp: Path) -> str:
    (tmp / "e.parquet").write_bytes(b"")
    return str(tmp / "e.parquet")


def _no_rows(tmp: Path) -> str:
    return write_parquet(tmp / "z.parquet", rows(10).slice(0, 0))


def _wrong_dim(tmp: Path) -> str:
    t = rows(10)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array([0.5] * 40, pa.float32()), 4)
    return write_parquet(tmp / "d.parquet", _with(t, "vec", vectors))


def _wrong_dim_in_one_row(tmp: Path) -> str:
    t = rows(3)
    vectors = pa.array([[0.1] * 8, [0.2] * 7, [0.3] * 8], pa.list_(pa.float32()))
    return write_parquet(tmp / "r.parquet", _with(t, "vec", vectors))


def _string_pk(tmp: Path) -> str:
    t = rows(10)
    return write_parquet(tmp / "s.parquet", _with(t, "pk", pa.array([str(i) for i in range(10)])))


def _null_pk(tmp: Path) -> str:
    t = rows(10)
    return write_parquet(tmp / "n.parquet", _with(t, "pk", pa.array([0, 1, None, *range(3, 10)], pa.int64())))


def _unknown_column(tmp: Path) -> str:
    return write_parquet(tmp / "u.parquet", rows(10).append_column("color", pa.array(["red"] * 10)))


def _missing_vector(tmp: Path) -> str:
    return write_parquet(tmp / "m.parquet", rows(10).drop_columns(["vec"]))


def _missing_scalar(tmp: Path) -> str:
    return write_parquet(tmp / "f.parquet", rows(10).drop_columns(["f"]))


def _null_vector(tmp: Path) -> str:
    t = rows(2)
    vectors = pa.array([[0.1] * 8, None], pa.list_(pa.float32(), 8))
    return write_parquet(tmp / "v.parquet", _with(t, "vec", vectors))


@pytest.mark.parametrize(
    ("make", "column", "reason"),
    [
        (_not_parquet, None, "is not a readable Parquet file"),
        (_truncated, None, "is not a readable Parquet file"),
        (_empty, None, "is empty"),
        (_no_rows, None, "has no rows"),
        (_wrong_dim, "vec", "has dimension 4, expected 8"),
        (_wrong_dim_in_one_row, "vec", "has dimension 7 at row 1, expected 8"),
        (_string_pk, "pk", "is string, expected int64"),
        (_null_pk, "pk", "is null at row 2"),
        (_unknown_column, "color", "is not a field of the collection"),
        (_missing_vector, "vec", "is missing (vector)"),
        (_missing_scalar, "f", "is missing (not nullable, and no default value)"),
        (_null_vector, "vec", "has a null vector at row 1"),
    ],
)
def test_a_bad_file_fails_the_job_naming_file_and_column(
    system: System,
    make: Callable[[Path], str],
    column: str | None,
    reason: str,
    producer: Producer,
    tmp_path: Path,
) -> None:
    info = new_collection(producer)
    good = write_parquet(tmp_path / "good.parquet", rows(50, 10_000))
    bad = make(tmp_path)

    job = run_import(system.store, system.settings, info, [good, bad])

    assert job.state is ImportState.FAILED
    assert job.reason.startswith(bad), job.reason
    assert reason in job.reason
    if column:
        assert f"column {column!r}" in job.reason
    assert_nothing_visible(system, info)


def test_duplicated_pks_across_files_fail_the_job_naming_both_files(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    a = write_parquet(tmp_path / "a.parquet", rows(50, 0))
    b = write_parquet(tmp_path / "b.parquet", rows(50, 49))

    job = run_import(store, settings, info, [a, b])

    assert job.state is ImportState.FAILED
    assert job.reason == f"{a}: column 'pk': primary key 49 appears more than once in the job (also in {b})"
    assert_nothing_visible(system, info)


def test_unknown_columns_are_dropped_when_asked_and_a_missing_nullable_scalar_is_null(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    nullable_f = CollectionSchema(tuple(replace(f, nullable=f.name == "f") for f in SCHEMA.fields))
    info = new_collection(producer, schema=nullable_f)
    data = rows(20).append_column("color", pa.array(["red"] * 20)).drop_columns(["f"])
    path = write_parquet(tmp_path / "a.parquet", data)

    job = run_import(store, settings, info, [path], drop_unknown_columns=True)

    assert job.state is ImportState.COMPLETED, job.reason
    got = visible(system, info)
    assert_imported_once(got, data)
    assert got["f"].null_count == 20 and "color" not in got.column_names


def test_a_file_that_disappears_after_pre_import_fails_the_job(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    keep = write_parquet(tmp_path / "keep.parquet", rows(30, 0))
    gone = write_parquet(tmp_path / "gone.parquet", rows(30, 100))

    def remove_after_pre_import(job: ImportJob) -> None:
        if job.state is ImportState.IMPORTING:
            Path(gone).unlink(missing_ok=True)

    job = run_import(store, settings, info, [keep, gone], on_progress=remove_after_pre_import)

    assert job.state is ImportState.FAILED
    assert job.reason.startswith(gone) and "does not exist" in job.reason
    assert_nothing_visible(system, info)


@pytest.mark.parametrize("when", ["pre-import done", "segments registered"])
def test_a_collection_dropped_during_the_job_fails_it_with_nothing_visible(
    when: str, store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    path = write_parquet(tmp_path / "a.parquet", rows(40))
    dropped = []

    def drop(job: ImportJob) -> None:
        at = job.progress == 10 if when == "pre-import done" else job.progress == 90
        if job.state is ImportState.IMPORTING and at and not dropped:
            dropped.append(producer.drop_collection(info.name))

    job = run_import(store, settings, info, [path], on_progress=drop)

    assert dropped and job.state is ImportState.FAILED
    assert f"collection {info.name!r} was dropped during the job" in job.reason

    assert {s.state.value for s in segments(store, info)} <= {"Dropped"}


def test_status_lists_import_jobs_with_the_reason_of_a_failed_one(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    from rich.console import Console

    from vchan_assets.catalog import Catalog
    from vchan_assets.status import collect_status, render_status

    info = new_collection(producer)
    job = run_import(store, settings, info, [_null_pk(tmp_path)])

    report = collect_status(Catalog(system), orphans=False)
    [listed] = [j for j in report["imports"] if j["job_id"] == job.job_id]
    assert listed["state"] == "Failed" and "is null at row 2" in listed["reason"]
    console = Console(width=250, record=True)
    console.print(render_status(report))
    text = console.export_text()
    assert "import jobs" in text and f"{job.job_id:,}" in text
