"""Benchmarks: `make bench` (or `python -m bench`) runs them all; see BENCHMARKS.md."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd


def bench_stack(prefix: str = "vchan-bench-", **etcd_options: Any) -> tuple[Path, EmbeddedEtcd, Settings]:
    """A scratch directory, a real etcd in it (`etcd_options`: EmbeddedEtcd's fields), and
    settings for one benchmark run.

    Segments are allowed up to 4 GB so no seal by size interrupts a measured sync or merge.
    The caller stops the etcd (and removes the directory when it is done with the files).
    """
    work = Path(tempfile.mkdtemp(prefix=prefix))
    etcd = EmbeddedEtcd(work / "etcd", **etcd_options).start()
    settings = replace(
        Settings.from_env({}),
        home=work,
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(work / "storage"),
        segment_max_size_mb=4096,
    )
    return work, etcd, settings
