"""Benchmarks: `make bench` (or `python -m bench`) runs them all; see BENCHMARKS.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System


def bench_stack(prefix: str = "vchan-bench-", **etcd_options: Any) -> tuple[Path, EmbeddedEtcd, Settings]:
    """A scratch directory, a real etcd in it (`etcd_options`: EmbeddedEtcd's fields), and
    settings for one benchmark run.

    Segments are allowed up to 4 GB so no seal by size interrupts a measured sync or merge,
    and the log has no write lag limit: benchmarks build logs of gigabytes before their first
    sync on purpose (bench.overload measures the limit). The caller stops the etcd (and removes the directory when it is done with the files).
    """
    work = Path(tempfile.mkdtemp(prefix=prefix))
    etcd = EmbeddedEtcd(work / "etcd", **etcd_options).start()
    settings = replace(
        Settings.from_env({}),
        home=work,
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(work / "storage"),
        segment_max_size_mb=4096,
        write_lag_limit_mb=0.0,
    )
    return work, etcd, settings


@contextlib.contextmanager
def bench_system(prefix: str) -> Iterator[tuple[Path, System]]:
    """`bench_stack` opened as a `System` (no Spark session yet); on exit the metastore
    is closed, the etcd stopped and the scratch directory removed."""
    work, etcd, settings = bench_stack(prefix)
    try:
        store = MetaStore.connect(settings)
        storage = Storage.from_settings(settings)
        storage.ensure_root()
        try:
            yield work, System(settings, store, storage)
        finally:
            store.close()
    finally:
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


def wait_for(condition: Callable[[], object], timeout: float, what: str, step: float = 0.02) -> float:
    """Poll `condition` every `step` seconds until it holds; the seconds it took
    (RuntimeError naming `what` past `timeout`)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(step)
    return time.monotonic() - started


def bench_parser(doc: str | None, rows: int, out: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring as help, `--rows` and `--out`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=rows)
    parser.add_argument("--out", default=out, help="the run's figures as JSON")
    return parser


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """A run's figures as JSON (bench/results/ stays local: the figures go to BENCHMARKS.md)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"written {out}")
