"""Local storage: files written without waiting for the disk, then made durable together."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from vchan_assets.storage import Storage, StorageError
from vchan_assets.storage.cache import ReadCache


def test_files_written_without_waiting_for_the_disk_are_whole_under_their_names_and_made_durable_together(
    tmp_path: Path,
) -> None:
    storage = Storage(str(tmp_path / "storage"))
    storage.ensure_root()
    keys = [f"insert_log/1/2/{i}" for i in range(3)]
    for key in keys[:2]:
        storage.write_atomic(key, key.encode() * 1000, durable=False)
    storage.write_parquet(keys[2], pa.table({"x": range(10)}), durable=False)

    assert [storage.read_bytes(k) for k in keys[:2]] == [k.encode() * 1000 for k in keys[:2]]
    assert storage.read_parquet(keys[2]).column("x").to_pylist() == list(range(10))
    assert not list((tmp_path / "storage").rglob(".tmp-*"))  # renamed, nothing left behind
    storage.make_durable(keys)

    # A file that is not there cannot be made durable: the sync must not report it.
    with pytest.raises(StorageError, match="insert_log/1/2/gone"):
        storage.make_durable([*keys, "insert_log/1/2/gone"])


def test_the_read_cache_keeps_the_most_recently_used_values_within_its_budget() -> None:
    loads: list[str] = []

    def loader(key: str) -> Callable[[], str]:
        def load() -> str:
            loads.append(key)
            return key * 10

        return load

    cache: ReadCache[str] = ReadCache(25, weigh=len)
    assert cache.get("a", loader("a")) == "a" * 10
    assert cache.get("b", loader("b")) == "b" * 10
    assert cache.get("a", loader("a")) == "a" * 10  # a hit: "a" is now the most recent
    cache.get("c", loader("c"))  # 30 > 25: the least recently used ("b") goes
    assert list(cache.found) == ["a", "c"] and cache.held == 20
    cache.get("b", loader("b"))
    assert loads == ["a", "b", "c", "b"]
    cache.get("huge", lambda: "x" * 100)  # over the budget alone: kept, the rest dropped
    assert list(cache.found) == ["huge"]
