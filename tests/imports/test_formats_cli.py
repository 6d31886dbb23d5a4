"""JSON lines and CSV inputs, and the `vchan import` command (submit, --wait with progress,
--status, --list, bad paths)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow as pa

from vchan_assets.config import Settings
from vchan_assets.imports.jobs import ImportState
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.import_files import assert_imported_once, rows, run_import, visible, write_parquet
from vchan_assets.testing.steps import new_collection
from vchan_assets.wal.producer import Producer


def _records(table: pa.Table) -> list[dict[str, object]]:
    return [{k: v for k, v in r.items()} for r in table.to_pylist()]


def test_json_lines_files_import_like_parquet(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    data = rows(40)
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(data)))

    job = run_import(store, settings, info, [str(path)], format="json")

    assert job.state is ImportState.COMPLETED, job.reason
    assert_imported_once(visible(system, info), data)


def test_csv_files_with_vectors_as_json_arrays_import(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    data = rows(30)
    lines = ["pk,vec,n,f,s,b"]
    for r in _records(data):
        vec = json.dumps(r["vec"])
        lines.append(f'{r["pk"]},"{vec}",{r["n"]},{r["f"]!r},{r["s"]},{str(r["b"]).lower()}')
    path = tmp_path / "a.csv"
    path.write_text("\n".join(lines) + "\n")

    job = run_import(store, settings, info, [str(path)], format="csv")

    assert job.state is ImportState.COMPLETED, job.reason
    assert_imported_once(visible(system, info), data)


def test_csv_vector_of_the_wrong_dimension_names_file_and_column(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    path = tmp_path / "bad.csv"
    path.write_text('pk,vec,n,f,s,b\n1,"[1.0, 2.0]",1,0.5,x,true\n')

    job = run_import(store, settings, info, [str(path)], format="csv")

    assert job.state is ImportState.FAILED
    assert job.reason == f"{path}: column 'vec': has dimension 2 at row 0, expected 8"


def _vchan(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VCHAN), "import", *args], env=cli_env(settings), capture_output=True, text=True, timeout=300
    )


def test_vchan_import_waits_with_progress_and_reports_status_and_list(
    system: System, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    data = rows(60)
    path = write_parquet(tmp_path / "a.parquet", data)

    done = _vchan(settings, "--collection", info.name, "--job-id", "31", "--wait", "--engine", "local", path)

    assert done.returncode == 0, done.stderr
    assert "import job 31 submitted" in done.stdout
    assert "rows/s" in done.stdout and "Completed" in done.stdout
    status = _vchan(settings, "--status", "31")
    assert status.returncode == 0 and "job 31: Completed 100%" in status.stdout
    assert "60 rows counted, 60 imported" in status.stdout
    listed = _vchan(settings, "--list")
    assert listed.returncode == 0 and "job 31: Completed" in listed.stdout
    assert_imported_once(visible(system, info), data)


def test_vchan_import_of_a_missing_path_or_unknown_job_exits_1_naming_it(
    settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    missing = _vchan(settings, "--collection", info.name, str(tmp_path / "nope.parquet"))
    assert missing.returncode == 1 and "nope.parquet: does not exist" in missing.stderr
    unknown = _vchan(settings, "--status", "123456")
    assert unknown.returncode == 1 and "import job 123456 does not exist" in unknown.stderr
    failed = _vchan(settings, "--collection", "no_such_collection", str(tmp_path))
    assert failed.returncode == 1 and "no_such_collection" in failed.stderr
