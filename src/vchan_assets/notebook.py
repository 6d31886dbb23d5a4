"""What the analyst notebooks share: the stack they look at, and waiting for a live
deployment to persist what they wrote.

Every notebook has a `parameters` cell (papermill's convention) with `MODE`:

- `"fresh"`: a new embedded stack (a real etcd on a free loopback port, files in a new
  temporary directory); other `VCHAN_*` settings are ignored. The notebook plays the
  cluster itself (it syncs, compacts) and cleans up after.
- `"live"`: the deployment the `VCHAN_*` settings point at: the stack `vchan up` started
  (`VCHAN_HOME`, default `.vchan`) or a cluster (`VCHAN_ETCD_ENDPOINTS`,
  `VCHAN_STORAGE_URI`, ...). The notebook only writes a collection of its own (a new name
  each run) and lets the deployment's DataNodes and DataCoord do their work.
"""

from __future__ import annotations

import os
import tempfile
import time

import pandas as pd

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.stack import Stack

MODES = ("fresh", "live")
PERSISTED_STATES = ("Flushed", "Dropped")


def open_stack(mode: str, **fresh_settings: str) -> tuple[Stack, Settings]:
    """The stack a notebook works on; `fresh_settings` (VCHAN_* variables) apply to a
    fresh stack only: a live deployment keeps its own configuration."""
    if mode not in MODES:
        raise ValueError(f"MODE must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
    if mode == "fresh":
        for key in [k for k in os.environ if k.startswith("VCHAN_")]:
            del os.environ[key]
        os.environ["VCHAN_HOME"] = tempfile.mkdtemp(prefix="vchan-notebook-")
        os.environ.update(fresh_settings)
    settings = Settings.from_env()
    return Stack.open(settings), settings


def collection_name(mode: str, base: str) -> str:
    """`base` on a fresh stack; on a live deployment a new name each run, so a notebook
    never writes into a collection that already exists there."""
    return base if mode == "fresh" else f"{base}_{time.strftime('%Y%m%d_%H%M%S')}"


def wait_until_persisted(catalog: Catalog, collection: str, timeout: float = 300) -> pd.DataFrame:
    """Wait until the deployment has persisted every message of `collection`'s logs (no
    lag on any vchannel) and flushed its sealed segments; returns `vchannels(collection)`.

    Raises TimeoutError naming the vchannels or segments still behind."""
    deadline = time.monotonic() + timeout
    while True:
        channels = catalog.vchannels(collection)
        segments = catalog.segments(collection)
        # An unknown lag (<NA>: the log after the checkpoint unreadable) is behind too.
        behind = channels[channels["lag_rows"].ne(0).fillna(True)]["vchannel"].tolist()
        open_segments = segments[~segments["state"].isin(PERSISTED_STATES)]["segment_id"].tolist()
        if not behind and not open_segments:
            return channels
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"collection {collection!r} not persisted within {timeout:.0f} s: vchannels behind "
                f"{behind}, segments not flushed {open_segments}; are the deployment's DataNodes "
                f"running (`vchan status`)?"
            )
        time.sleep(1)
