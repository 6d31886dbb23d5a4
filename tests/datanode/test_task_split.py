"""How a sync shares its log files between tasks: the sync lasts as long as its largest task."""

from __future__ import annotations

from vchan_assets.datanode.sync import split_by_size
from vchan_assets.wal.reader import WalFile


def _files(*sizes: int) -> list[WalFile]:
    return [WalFile(f"wal/ch/{i:020d}.parquet", i, 1, i, size) for i, size in enumerate(sizes)]


def _sizes(chunks: list[list[WalFile]]) -> list[list[int]]:
    return [[f.size_bytes for f in chunk] for chunk in chunks]


def test_files_are_split_into_consecutive_runs_of_about_equal_bytes() -> None:
    # A channel's first file (the create_collection message) is tiny: splitting by count
    # gave 4 of the 10 batches to one task and 6 to the other.
    files = _files(1_000, *[50_000_000] * 10)
    chunks = split_by_size(files, 2)
    assert _sizes(chunks) == [[1_000, *[50_000_000] * 5], [50_000_000] * 5]
    assert [f for chunk in chunks for f in chunk] == files


def test_a_file_larger_than_a_share_leaves_fewer_tasks_and_never_an_empty_one() -> None:
    assert _sizes(split_by_size(_files(10, 1_000_000, 10), 3)) == [[10], [1_000_000], [10]]
    assert _sizes(split_by_size(_files(1_000_000, 10), 2)) == [[1_000_000], [10]]
    assert _sizes(split_by_size(_files(5), 4)) == [[5]]
    assert split_by_size([], 2) == [[]]
