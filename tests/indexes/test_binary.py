"""Binary vectors' distances and BIN_IVF_FLAT in faiss (`indexes.binary`), against a numpy
reference that counts bits one pair at a time; which metrics and index types a field takes
(no etcd)."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from vchan_assets.indexes import binary
from vchan_assets.indexes.build import load_index
from vchan_assets.indexes.params import check_fits, default_metric
from vchan_assets.model import FieldSchema, IndexType, MetricType

DIM = 128
BITS = FieldSchema.from_spec(101, "bits", f"binary_vector({DIM})")
FLOATS = FieldSchema.from_spec(102, "vec", "float16_vector(8)")


def reference(a: np.ndarray, b: np.ndarray, metric: MetricType) -> float:
    x, y = np.unpackbits(a).astype(bool), np.unpackbits(b).astype(bool)
    if metric is MetricType.HAMMING:
        return float(np.count_nonzero(x != y))
    union = np.count_nonzero(x | y)
    return 0.0 if not union else 1 - np.count_nonzero(x & y) / union


def clustered(n: int, seed: int = 0) -> np.ndarray:
    """Bit vectors around 32 centres, a few bits flipped each (what IVF finds clusters in)."""
    rng = np.random.default_rng(seed)
    centres = rng.integers(0, 2, (32, DIM), dtype=np.uint8)
    flips = rng.random((n, DIM)) < 0.05
    return np.packbits(centres[rng.integers(0, 32, n)] ^ flips, axis=1)


@pytest.mark.parametrize("metric", [MetricType.HAMMING, MetricType.JACCARD])
def test_distances_are_the_bit_counts_of_milvus(metric: MetricType) -> None:
    base = clustered(300)
    base[0] = 0  # no bit set: Jaccard distance 0 to itself
    found = binary.distances(base[:5], base, metric)
    expected = [[reference(q, b, metric) for b in base] for q in base[:5]]
    assert np.allclose(found, expected, atol=1e-6)
    assert found[0, 0] == 0


@pytest.mark.parametrize("metric", [MetricType.HAMMING, MetricType.JACCARD])
def test_one_query_counted_by_table_agrees_with_the_bit_products(metric: MetricType) -> None:
    base = clustered(500, seed=2)
    assert np.allclose(
        binary.one_query_distances(base[7], base, metric), binary.distances(base[7:8], base, metric)[0]
    )


@pytest.mark.parametrize("metric", [MetricType.HAMMING, MetricType.JACCARD])
def test_an_ivf_search_probing_every_list_finds_the_exact_distances(metric: MetricType) -> None:
    base = clustered(3000, seed=3)
    index = binary.new_ivf(DIM, 16)
    index.train(base)
    index.add(base)
    queries = clustered(5, seed=6)
    exact, _ = binary.nearest(queries, base, metric, 10)
    found, positions = binary.probed_search(index, queries, 10, 16, metric, None)
    assert np.allclose(found, exact, atol=1e-6)
    assert np.allclose(
        binary.distances(queries, base, metric)[np.arange(5)[:, None], positions], found, atol=1e-6
    )


def test_ivf_finds_each_vector_itself_at_distance_0_by_both_metrics_and_filtered() -> None:
    base = clustered(5000)
    index = binary.new_ivf(DIM, 32)
    index.train(base)
    index.add(base)
    loaded = load_index(binary.serialize(index).tobytes())  # (told apart from float indexes by its header)
    queries = base[[3, 400, 4999]]
    for metric in (MetricType.HAMMING, MetricType.JACCARD):
        found, positions = binary.ivf_search(loaded, queries, 5, 8, metric, None)
        assert positions[:, 0].tolist() == [3, 400, 4999] and (found[:, 0] == 0).all()
        assert (np.diff(found, axis=1) >= 0).all()
    allowed = np.ones(len(base), dtype=bool)
    allowed[400] = False
    _, positions = binary.ivf_search(loaded, queries, 5, 8, MetricType.HAMMING, allowed)
    assert 400 not in positions[1] and allowed[positions[positions >= 0]].all()


def test_an_exact_hamming_search_agrees_with_faiss() -> None:
    base = clustered(2000, seed=4)
    exact = faiss.IndexBinaryFlat(DIM)
    exact.add(base)
    want, _ = exact.search(base[:20], 10)
    found, _ = binary.nearest(base[:20], base, MetricType.HAMMING, 10)
    assert np.array_equal(found, want)


def test_binary_metrics_and_index_types_are_for_binary_fields_only() -> None:
    check_fits(BITS, MetricType.JACCARD, IndexType.BIN_IVF_FLAT)
    check_fits(FLOATS, MetricType.IP, IndexType.HNSW)
    assert (default_metric(BITS), default_metric(FLOATS)) == (MetricType.HAMMING, MetricType.L2)
    with pytest.raises(
        ValueError, match="metric L2 is not for the binary vector field 'bits': one of HAMMING, JACCARD"
    ):
        check_fits(BITS, MetricType.L2)
    with pytest.raises(ValueError, match="index type IVF_FLAT is not for the binary vector field 'bits'"):
        check_fits(BITS, MetricType.HAMMING, IndexType.IVF_FLAT)
    with pytest.raises(ValueError, match="metric HAMMING is not for the float vector field 'vec'"):
        check_fits(FLOATS, MetricType.HAMMING)
    with pytest.raises(ValueError, match="index type BIN_FLAT is not for the float vector field 'vec'"):
        check_fits(FLOATS, MetricType.L2, IndexType.BIN_FLAT)
