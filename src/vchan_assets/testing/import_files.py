"""Steps of the bulk-import tests: input files written with plain pyarrow, an import job run
in-process or by `vchan import` in a process of its own (to be killed at a failpoint), what
a reader sees afterwards, and a garbage collection pass that takes every orphan."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vchan_assets import imports
from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.imports.jobs import ImportJob
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, VCHAN, cli_env, segments
from vchan_assets.wal.producer import generate_rows

DIM = 8


def rows(n: int, start_pk: int = 0, seed: int = 0) -> pa.Table:
    """Rows of SCHEMA as a user would hold them: vectors as fixed_size_list<float32>."""
    table = generate_rows(SCHEMA, n, start_pk=start_pk, seed=seed)
    flat = np.frombuffer(table["vec"].combine_chunks().buffers()[1], dtype="<f4")[: n * DIM]
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(flat), DIM)
    return table.set_column(table.schema.get_field_index("vec"), "vec", vectors)


def write_parquet(path: Path, table: pa.Table, row_group_size: int | None = None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def run_import(
    store: MetaStore,
    settings: Settings,
    info: CollectionInfo,
    paths: list[str],
    on_progress: Callable[[ImportJob], None] | None = None,
    **options: Any,
) -> ImportJob:
    """Submit a job for `paths` and run it here, in-process; its final meta."""
    job_id = imports.submit(info.name, paths, store=store, settings=settings, **options)
    return imports.run(job_id, engine="local", on_progress=on_progress, store=store, settings=settings)


def visible(system: System, info: CollectionInfo) -> pa.Table:
    """Every row a reader of `info` sees now."""
    table = Catalog(system).read_collection(info.name, as_arrow=True)
    assert isinstance(table, pa.Table)
    return table


def live_segments(store: MetaStore, info: CollectionInfo) -> list[int]:
    return sorted(s.id for s in segments(store, info) if s.state is SegmentState.FLUSHED)


def assert_nothing_visible(system: System, info: CollectionInfo) -> None:
    assert visible(system, info).num_rows == 0
    states = {s.state for s in segments(system.store, info)}
    assert states <= {SegmentState.DROPPED}, f"segments left in {states}"


def assert_imported_once(table: pa.Table, expected: pa.Table) -> None:
    """Every expected row exactly once, values unchanged (vectors compared as float32 bytes)."""
    got = table.sort_by("pk")
    assert got["pk"].to_pylist() == sorted(expected["pk"].to_pylist())
    want = expected.sort_by("pk")
    for column in ("n", "s", "b"):
        assert got[column].to_pylist() == want[column].to_pylist(), column
    vectors = np.frombuffer(b"".join(v.as_py() for v in got["vec"]), dtype="<f4")
    assert np.array_equal(vectors, want["vec"].combine_chunks().flatten().to_numpy().astype("<f4"))


def vchan_import(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`vchan import --wait --engine local *args` in a process of its own, on `settings`
    and `env` (e.g. VCHAN_FAILPOINT)."""
    return subprocess.run(
        [str(VCHAN), "import", "--wait", "--engine", "local", *args],
        env=cli_env(settings, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def collect_garbage(store: MetaStore, storage: Storage, settings: Settings) -> None:
    """One garbage collection pass that takes any orphan or Dropped segment of now."""
    quick = replace(settings, gc_missing_tolerance=1.0, gc_drop_tolerance=1.0)
    GarbageCollector(System(quick, store, storage), clock=lambda: time.time() + 5).run()
