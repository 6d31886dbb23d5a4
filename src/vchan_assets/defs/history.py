"""What the Dagster instance remembers of the syncs, as DataFrames (for notebooks).

with open_instance() as instance:
    runs = sync_history(instance)   # one row per sync materialization of `binlogs`
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pandas as pd

from vchan_assets.config import Settings
from vchan_assets.defs.sync.assets import BINLOGS
from vchan_assets.deploy.service import instance_home

SYNC_COLUMNS = ["end_time", "vchannel", "rows", "deletes", "bytes", "seconds", "run_id"]


def open_instance(home: str | Path | None = None) -> dg.DagsterInstance:
    """The instance at `home`, else DAGSTER_HOME, else the one `vchan up` keeps under
    VCHAN_HOME."""
    path = Path(home or os.environ.get("DAGSTER_HOME") or instance_home(Settings.from_env()))
    if not (path / "dagster.yaml").exists() and not (path / "history").exists():
        raise FileNotFoundError(
            f"no Dagster instance at {path}: start one with `vchan up`, or set DAGSTER_HOME"
        )
    return dg.DagsterInstance.from_config(str(path))


def _number(metadata: dict[str, dg.MetadataValue], key: str) -> float | None:
    value = metadata.get(key)
    return None if value is None else value.value  # type: ignore[return-value]


def sync_history(instance: dg.DagsterInstance, limit: int = 10_000) -> pd.DataFrame:
    """Each sync's rows, deletes, bytes and seconds, newest last (skipped syncs left out)."""
    records = instance.fetch_materializations(BINLOGS.key, limit=limit).records
    rows = []
    for record in records:
        mat = record.asset_materialization
        if mat is None:
            continue
        meta = dict(mat.metadata)
        skipped = meta.get("skipped")
        if skipped is not None and skipped.value:
            continue
        rows.append(
            {
                "end_time": pd.Timestamp(record.timestamp, unit="s", tz="UTC"),
                "vchannel": mat.partition,
                "rows": _number(meta, "rows"),
                "deletes": _number(meta, "deletes"),
                "bytes": _number(meta, "bytes"),
                "seconds": _number(meta, "seconds"),
                "run_id": record.run_id,
            }
        )
    return pd.DataFrame(rows, columns=SYNC_COLUMNS).sort_values("end_time", ignore_index=True)
