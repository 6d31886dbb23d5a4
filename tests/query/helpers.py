"""Shared steps of the read tests: a read in its own process, stopped at a failpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.model import CollectionInfo
from vchan_assets.testing.harness import cli_env

READ = """
import json
import sys
from vchan_assets.catalog import Catalog
with Catalog.open() as catalog:
    rows = catalog.read_collection(sys.argv[1], with_vectors=False)
    print("ROWS", len(rows))
    print("PKS", json.dumps(sorted(rows["pk"].tolist())))
"""


def stopped_read(
    settings: Settings, info: CollectionInfo, tmp_path: Path, failpoint: str = "read_planned", **env: str
) -> subprocess.Popen[str]:
    """A read of the collection at now in its own process (`catalog.read_collection`),
    SIGSTOPped at its failpoint until SIGCONT; it prints ROWS n and PKS [sorted pks]."""
    marker = tmp_path / "failpoint"
    proc = subprocess.Popen(
        [sys.executable, "-c", READ, info.name],
        env=cli_env(settings, VCHAN_FAILPOINT=f"{failpoint}=stop", VCHAN_FAILPOINT_MARKER=str(marker), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text().startswith(failpoint)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the read never reached its failpoint"
        time.sleep(0.05)
    return proc


def read_pks(out: str) -> list[int]:
    """The pks a `stopped_read` printed."""
    [line] = [line for line in out.splitlines() if line.startswith("PKS ")]
    return list(json.loads(line.removeprefix("PKS ")))
