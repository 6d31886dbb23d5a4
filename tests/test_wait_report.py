"""`VCHAN_TEST_WAITS`: a test run lists its waits nearest their timeout (a wait that needs
most of its budget on a quiet machine is the next flaky test under load) and writes every
wait to a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vchan_assets.testing.wait_report import ENV
from vchan_assets.testing.waiting import Wait, on_wait, wait_until

pytest_plugins = ["pytester"]

WAITING_TESTS = """
import time
from vchan_assets.testing.waiting import wait_until

def test_waits_most_of_its_timeout():
    started = time.monotonic()
    wait_until(lambda: time.monotonic() - started > 0.3, 0.4, "a slow condition", interval=0.01)

def test_waits_for_nothing():
    wait_until(lambda: True, 10, "a condition that holds at once")

def test_times_out():
    wait_until(lambda: False, 0.05, "a condition that never holds", interval=0.01)
"""


def test_a_run_lists_its_waits_nearest_their_timeout_and_writes_them_all(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "waits"))
    pytester.makepyfile(test_waiting=WAITING_TESTS)
    # In a process of its own: this run's waits (one times out on purpose) stay out of the
    # report of the run that runs this test.
    result = pytester.runpytest_subprocess("-p", "vchan_assets.testing.wait_report", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)

    [written] = (tmp_path / "waits").glob("waits-*.json")
    waits = {w["what"]: w for w in json.loads(written.read_text())}
    assert set(waits) == {
        "a slow condition",
        "a condition that holds at once",
        "a condition that never holds",
    }
    slow = waits["a slow condition"]
    assert slow["held"] and slow["timeout"] == 0.4 and 0.3 <= slow["took"] < 0.4
    assert slow["test"] == "test_waiting.py::test_waits_most_of_its_timeout (call)"
    assert not waits["a condition that never holds"]["held"]
    # Nearest first: the wait that timed out, then the one that used most of its budget;
    # the wait that held at once last.
    lines = result.stdout.lines
    at = lines.index(next(line for line in lines if "Waits nearest their timeout (3 waits" in line))
    listed = lines[at + 1 : at + 4]
    assert "TIMED OUT" in listed[0] and "a condition that never holds" in listed[0]
    assert (
        "a slow condition" in listed[1]
        and "[test_waiting.py::test_waits_most_of_its_timeout (call)]" in listed[1]
    )
    assert "a condition that holds at once" in listed[2]


def test_a_recorder_stops_hearing_waits_once_stopped() -> None:
    heard: list[Wait] = []
    stop = on_wait(heard.append)
    wait_until(lambda: True, 1, "first")
    stop()
    wait_until(lambda: True, 1, "second")
    assert [w.what for w in heard] == ["first"]
