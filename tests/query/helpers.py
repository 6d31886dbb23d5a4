"""Shared steps of the read tests: a read in its own process, stopped at a failpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.model import CollectionInfo
from vchan_assets.testing.harness import cli_env, fast_settings
from vchan_assets.testing.waiting import wait_until

TIME_TRAVEL = 6.0  # seconds: GC removes a dropped segment's files this long after its drop
# A read in the past goes back at least this far, and stays this far inside the window
# (its own "now" is taken a moment after the test picks its T).
MARGIN = 1.5


def race_settings(settings: Settings) -> Settings:
    """The lifecycle at test speed, for the processes and the reader alike: a lifecycle step
    and a GC pass every second, dropped segments collected TIME_TRAVEL seconds after their
    drop, a plan whose executor was killed failed after 5 s."""
    return replace(
        fast_settings(settings),
        lifecycle_interval=1.0,
        gc_interval=1.0,
        gc_drop_tolerance=1.0,
        gc_missing_tolerance=120.0,  # far above any sync's files-to-meta time, even under load
        wal_retention=1.0,
        compaction_timeout=5.0,
        time_travel=TIME_TRAVEL,
    )


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
    settings: Settings,
    info: CollectionInfo,
    tmp_path: Path,
    failpoint: str = "read_planned",
    action: str = "stop",
    **env: str,
) -> subprocess.Popen[str]:
    """A read of the collection at now in its own process (`catalog.read_collection`),
    SIGSTOPped at its failpoint until SIGCONT (`action` "stop-once": only the first time it
    gets there); it prints ROWS n and PKS [sorted pks]."""
    marker = tmp_path / "failpoint"
    proc = subprocess.Popen(
        [sys.executable, "-c", READ, info.name],
        env=cli_env(
            settings, VCHAN_FAILPOINT=f"{failpoint}={action}", VCHAN_FAILPOINT_MARKER=str(marker), **env
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def reached() -> bool:
        assert proc.poll() is None, proc.communicate()
        return marker.exists() and marker.read_text().startswith(failpoint)

    wait_until(reached, 60, "the read to reach its failpoint", interval=0.05)
    return proc


def read_pks(out: str) -> list[int]:
    """The pks a `stopped_read` printed."""
    [line] = [line for line in out.splitlines() if line.startswith("PKS ")]
    return list(json.loads(line.removeprefix("PKS ")))
