"""The stats log's bloom filter layout: files already written must stay readable."""

from __future__ import annotations

import numpy as np

from vchan_assets.datanode.stats import PkStats, _positions


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
