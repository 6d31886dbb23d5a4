"""The stats log's bloom filter layout: files already written must stay readable."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets.datanode.stats import FALSE_POSITIVE_RATE, SIPHASH, WORDS64, PkStats, _positions, text_keys


def test_the_bloom_filter_sets_bit_i_as_bit_i_mod_8_of_byte_i_div_8_for_each_hash_position() -> None:
    pks = np.array([7, -3, 2**40, 12345, 7], dtype=np.int64)
    stats = PkStats.build(pks)
    expected = np.zeros(stats.m // 8, dtype=np.uint8)
    for idx in _positions(pks, stats.m, stats.k):
        for i in idx.tolist():
            expected[i // 8] |= 1 << (i % 8)
    assert stats.bits == expected.tobytes()
    assert (stats.entries, stats.pk_min, stats.pk_max) == (5, -3, 2**40)
    assert PkStats.from_bytes(stats.to_bytes()) == stats
    assert stats.might_contain(pks).all()


# A VarChar stats log as the code before the `words64` hash wrote it (keys doc-000 ..
# doc-019, SipHash keys, no "hash" field).
SIPHASH_LOG = (
    b'{"v": 1, "entries": 20, "pk_min": "doc-000", "pk_max": "doc-019", "m": 512, "k": 10, "bits": '
    b'"gOAw4DQzQhwphLhWxIMpKAGAHYnATIQAV4EMJFbhMHCAIvAMBFdBkYChQOidDCiBGEMCAGHcqMOqYwkCE1NTAQ=="}'
)


def test_a_varchar_stats_log_written_before_the_words64_hash_still_finds_its_keys() -> None:
    stats = PkStats.from_bytes(SIPHASH_LOG)
    assert stats.hash == SIPHASH
    keys = np.array([f"doc-{i:03d}" for i in range(20)], dtype=object)
    assert stats.might_contain(keys).all()
    absent = np.array([f"doc-{i:03d}x" for i in range(200)], dtype=object)
    assert stats.might_contain(absent).mean() < 0.05
    assert PkStats.from_bytes(stats.to_bytes()) == stats  # and it is written back as it was
    assert b'"hash"' not in stats.to_bytes()


@pytest.mark.parametrize(
    "keys",
    [
        [str(uuid.UUID(int=i)) for i in range(20_000)],  # one length, back to back
        [f"k{i}-{'x' * (i % 70)}" for i in range(20_000)],  # 70 lengths, some over 64 bytes
        ["", "é", "ab" * 5, "y" * 3_000, *(f"{i}" for i in range(5_000))],
    ],
    ids=["uuids", "lengths", "odd"],
)
def test_varchar_keys_are_hashed_from_the_arrow_buffers_to_the_same_keys_however_they_are_given(
    keys: list[str],
) -> None:
    column = pa.array(keys, pa.string())
    stats = PkStats.build(column)
    assert stats.hash == WORDS64 and b'"hash": "words64"' in stats.to_bytes()
    assert (stats.pk_min, stats.pk_max, stats.entries) == (min(keys), max(keys), len(keys))
    # The same hashes from an object array, a large_string column, a sliced or chunked one.
    assert PkStats.build(np.array(keys, dtype=object)) == stats
    assert PkStats.build(pa.chunked_array([column.slice(0, 7), column.slice(7)])) == stats
    assert PkStats.build(column.cast(pa.large_string())) == stats
    hashed = text_keys(column)
    assert len(set(hashed.tolist())) == len(set(keys))
    assert (text_keys(column.slice(3)) == hashed[3:]).all()
    read = PkStats.from_bytes(stats.to_bytes())
    assert read.might_contain(np.array(keys, dtype=object)).all()
    others = np.array([f"absent-{i}" for i in range(20_000)], dtype=object)
    assert read.might_contain(others).mean() < 3 * FALSE_POSITIVE_RATE
