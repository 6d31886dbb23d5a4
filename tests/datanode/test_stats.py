"""The stats log's bloom filter layout: files already written must stay readable."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets.datanode.stats import (
    FALSE_POSITIVE_RATE,
    SIPHASH,
    WORDS64,
    PkStats,
    _positions,
    bloom_size,
    text_keys,
)


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


@pytest.mark.parametrize("n", [1_000, 5_000, 100_000, 583_000])
def test_the_filter_uses_the_fewest_hash_functions_that_meet_the_rate_in_its_rounded_up_bits(n: int) -> None:
    """m is rounded up to a power of two, so it often has up to twice the bits the rate
    needs: k is then lower than the unrounded optimum of 10 (fewer bits to set per key),
    and the rate is still met, by the formula and measured on keys not in the filter."""
    m, k = bloom_size(n)
    assert m & (m - 1) == 0 and m >= -n * math.log(FALSE_POSITIVE_RATE) / math.log(2) ** 2
    assert (1 - math.exp(-k * n / m)) ** k <= FALSE_POSITIVE_RATE
    assert k == 1 or (1 - math.exp(-(k - 1) * n / m)) ** (k - 1) > FALSE_POSITIVE_RATE  # the fewest
    assert k < 10 or m < 1.1 * -n * math.log(FALSE_POSITIVE_RATE) / math.log(2) ** 2
    keys = np.random.default_rng(n).choice(2**62, size=n + 200_000, replace=False)
    stats = PkStats.build(keys[:n])
    assert (stats.m, stats.k) == (m, k)
    assert stats.might_contain(keys[:n]).all()
    assert stats.might_contain(keys[n:]).mean() < 1.5 * FALSE_POSITIVE_RATE


def test_a_stats_log_written_with_ten_hash_functions_is_read_with_its_own_k() -> None:
    """Files written before the adaptive k state k = 10; a reader takes m and k from the file."""
    keys = np.arange(5_000, dtype=np.int64) * 3
    m, _ = bloom_size(len(keys))
    flags = np.zeros(m, dtype=bool)
    for idx in _positions(keys, m, 10):
        flags[idx.astype(np.int64)] = True
    bits = np.packbits(flags, bitorder="little").tobytes()
    old = PkStats(len(keys), 0, int(keys[-1]), m, 10, bits)
    read = PkStats.from_bytes(old.to_bytes())
    assert read.k == 10 and read.might_contain(keys).all()
    assert read.might_contain(keys + 1).mean() < FALSE_POSITIVE_RATE
