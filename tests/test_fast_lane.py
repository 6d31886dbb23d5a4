"""The fast lane (`pytest -m "not integration"`, `make check`) leaves out every test that needs a
live service and keeps the others: tests/conftest.py marks a test `integration` by the fixtures
it uses (through the fixtures they build on) and by its directory, and refuses a test it did not
mark to start the CLI or a live service as a process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vchan_assets.testing.harness import SyncLag
from vchan_assets.testing.waiting import WaitTimeout, wait_until

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

LIVE = {
    # store -> settings -> etcd: live through its fixtures' fixtures
    "tests/meta/test_store.py::test_guarded_txn_rejects_a_stale_writer_and_writes_nothing",
    # in tests/defs, which runs Dagster against a Spark Connect server, though it uses no fixture
    "tests/defs/test_definitions.py::test_the_definitions_load_with_every_asset_sensor_job_and_resource",
    # starts a Spark session itself: marked by hand
    "tests/test_stack.py::test_spark_session_factory_runs_a_job_within_its_deadline",
}
PURE = {
    "tests/meta/test_keys.py::test_the_default_root_is_vchan",
    # its module's own `storage` (a directory) replaces the one built on `settings`, and etcd
    "tests/wal/test_log_format.py::test_a_missing_data_file_is_corrupt_naming_both_files",
    "tests/test_stack.py::test_a_spark_connect_record_without_its_pid_or_port_counts_as_no_server",
}


def test_the_fast_lane_deselects_the_live_tests_and_keeps_the_pure_ones(pytester: pytest.Pytester) -> None:
    recorded = pytester.inline_run(
        "--collect-only",
        "-p",
        "no:cacheprovider",
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pyproject.toml"),
        "-m",
        "not integration",
        *(str(ROOT / node) for node in sorted(LIVE | PURE)),
    )
    [finished] = recorded.getcalls("pytest_collection_finish")
    kept = {item.nodeid for item in finished.session.items}
    deselected = {item.nodeid for call in recorded.getcalls("pytest_deselected") for item in call.items}

    assert kept == PURE
    assert deselected == LIVE


def test_a_test_not_marked_integration_cannot_start_the_cli() -> None:
    vchan = Path(sys.executable).parent / "vchan"
    # (`--help`: were it allowed, the child would print its usage and start nothing)
    with pytest.raises(RuntimeError, match="is not marked `integration`"):
        subprocess.run([str(vchan), "--help"], capture_output=True, timeout=60)
    with pytest.raises(RuntimeError, match="is not marked `integration`"):
        subprocess.run([sys.executable, "-m", "vchan_assets.cli", "--help"], capture_output=True, timeout=60)
    # other children are allowed
    assert subprocess.run(["true"], timeout=60).returncode == 0


def test_a_wait_on_all_synced_that_times_out_names_the_channels_behind() -> None:
    """`all_synced` is false while a channel lags, and a wait on it that times out says which
    channel, how far behind and who watches it, not just "last saw: False"."""
    behind = SyncLag((("c-dml_0v0", "checkpoint 3 < head 9"),), store=None)
    assert not behind and SyncLag()
    with pytest.raises(WaitTimeout, match=r"c-dml_0v0: checkpoint 3 < head 9, watched by \[\]"):
        wait_until(lambda: behind, 0.05, "every channel caught up", interval=0.01)
