"""A failpoint's marker appears whole: a test that sees the file reads the failpoint's name
and the pid at once.

The marker was created, then written: a test that waited for it to exist and read the pid
could read an empty file (`tests/query/test_stream_source.py`'s killed driver, on
2026-11-30: `IndexError` on the empty content). With the marker written in two steps, the
observer below saw it empty in 481-847 of 2,000 markers (four runs)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vchan_assets.failpoints import mark

MARKERS = 2000


@pytest.fixture
def switching() -> Iterator[None]:
    """Threads handed the interpreter as often as it allows, so an observer runs between
    any two steps of the writer's."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("first", [True, False], ids=["once", "every time"])
def test_a_marker_is_never_seen_without_its_content(tmp_path: Path, switching: None, first: bool) -> None:
    seen: list[str] = []

    def observe() -> None:
        for i in range(MARKERS):
            path = tmp_path / f"marker{i}"
            while not path.exists():
                pass
            seen.append(path.read_text())

    observer = threading.Thread(target=observe)
    observer.start()
    for i in range(MARKERS):
        assert mark(str(tmp_path / f"marker{i}"), "stream_read", first=first)
    observer.join(timeout=60)

    assert seen == [f"stream_read {os.getpid()}"] * MARKERS
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"marker{i}" for i in range(MARKERS))


def test_only_the_first_process_marks_a_once_marker(tmp_path: Path) -> None:
    marker = str(tmp_path / "marker")
    assert mark(marker, "stream_read", first=True)
    assert not mark(marker, "index_built", first=True)
    assert Path(marker).read_text() == f"stream_read {os.getpid()}"
    mark(marker, "index_built")  # a plain failpoint marks every time
    assert Path(marker).read_text() == f"index_built {os.getpid()}"
    assert [p.name for p in tmp_path.iterdir()] == ["marker"]
