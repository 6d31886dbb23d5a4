"""Binary vectors in faiss: their HAMMING and JACCARD distances, the BIN_IVF_FLAT index and
its search.

A binary vector is a row of dim / 8 uint8 bytes of packed bits (`fields.decode_binary`), as
faiss's binary indexes take it. Distances as Milvus reports them, smaller nearer for both:
HAMMING is the number of bits that differ; JACCARD is 1 - |a and b| / |a or b| (0 between
two vectors with no bit set).

faiss's binary indexes measure Hamming distances only. A BIN_IVF_FLAT index
(`IndexBinaryIVF` over an `IndexBinaryFlat` quantizer) is clustered by Hamming distance
whatever its metric. A HAMMING search is faiss's own. A JACCARD search probes the `nprobe`
lists whose centroids are nearest the query (by Hamming distance, as faiss assigns them) and
ranks every vector of those lists by its Jaccard distance, computed here from the list's
codes (`probed_search`): an IVF search by Jaccard distance over Hamming clusters, not Hamming
candidates re-ranked. A filtered search takes the same path with HAMMING too: faiss's
`IndexBinaryIVF.search` takes `nprobe` in its search parameters but refuses an ID selector
("IDSelector is not supported for IndexBinaryIVF", faiss 1.15).
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np

from vchan_assets.model import MetricType

# Bits of one block of an exact search's unpacked base (rows x dim, float32): 64 MiB.
_BLOCK_BITS = 1 << 24
# faiss writes a binary index under a four-character code beginning with these bytes
# ("IBxF" IndexBinaryFlat, "IBwF" IndexBinaryIVF, ...); no other index's code does.
BINARY_FOURCC_PREFIX = b"IB"
_FAISS: Any = faiss  # (its type stubs lack the search parameter classes)
# The bits set in each byte value: one query's distances by table lookups.
_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint16)


def block_rows(dim: int) -> int:
    """Rows of one block of an exact search over `dim`-bit vectors (its unpacked bits
    bounded to `_BLOCK_BITS` values)."""
    return max(1, _BLOCK_BITS // max(dim, 1))


def distances(queries: np.ndarray, base: np.ndarray, metric: MetricType) -> np.ndarray:
    """(nq, n) float32 HAMMING or JACCARD distances between the packed rows of `queries`
    and `base`, by matrix products of their bits (float32 counts are exact up to 2^24
    bits, beyond Milvus' largest dim)."""
    q = np.unpackbits(queries, axis=1).astype(np.float32)
    b = np.unpackbits(base, axis=1).astype(np.float32)
    both = q @ b.T
    either = q.sum(1)[:, None] + b.sum(1)[None, :]  # |a| + |b|
    if metric is MetricType.HAMMING:
        return either - 2 * both
    if metric is not MetricType.JACCARD:
        raise ValueError(f"{metric} is not a metric of binary vectors")
    union = either - both
    return np.where(union > 0, 1 - both / np.maximum(union, 1), 0).astype(np.float32)


def one_query_distances(query: np.ndarray, base: np.ndarray, metric: MetricType) -> np.ndarray:
    """`distances` of one packed query (a row) to each row of `base`, by counting the bits
    of each byte in a table: cheaper than unpacking the base for a single query."""
    if metric is MetricType.HAMMING:
        return _POPCOUNT[base ^ query].sum(1, dtype=np.int32).astype(np.float32)
    if metric is not MetricType.JACCARD:
        raise ValueError(f"{metric} is not a metric of binary vectors")
    both = _POPCOUNT[base & query].sum(1, dtype=np.int32)
    either = _POPCOUNT[base | query].sum(1, dtype=np.int32)
    return np.where(either > 0, 1 - both / np.maximum(either, 1), 0).astype(np.float32)


def nearest(
    queries: np.ndarray, base: np.ndarray, metric: MetricType, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """(distances, positions), each (nq, min(k, n)), of the k nearest rows of `base` per
    query, nearest first."""
    found = (
        one_query_distances(queries[0], base, metric)[None, :]
        if len(queries) == 1
        else distances(queries, base, metric)
    )
    take = min(k, found.shape[1])
    best = np.argpartition(found, take - 1, axis=1)[:, :take]
    picked = np.take_along_axis(found, best, axis=1)
    order = np.argsort(picked, axis=1, kind="stable")
    return np.take_along_axis(picked, order, axis=1), np.take_along_axis(best, order, axis=1)


def new_ivf(dim: int, nlist: int) -> Any:
    """An empty BIN_IVF_FLAT index of `dim`-bit vectors and `nlist` lists (faiss's Python
    wrapper keeps the quantizer alive with the index)."""
    return faiss.IndexBinaryIVF(faiss.IndexBinaryFlat(dim), dim, nlist)


def serialize(index: Any) -> np.ndarray:
    return faiss.serialize_index_binary(index)


def is_serialized_binary(data: bytes | np.ndarray) -> bool:
    return bytes(data[:2]) == BINARY_FOURCC_PREFIX


def deserialize(data: np.ndarray) -> Any:
    return faiss.deserialize_index_binary(data)


def ivf_search(
    index: Any, queries: np.ndarray, k: int, nprobe: int, metric: MetricType, allowed: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(distances, positions) of the k nearest of a BIN_IVF_FLAT index's vectors per query,
    probing `nprobe` lists; `allowed` (a bool per row, None: all) leaves rows out. Position
    -1 pads a query with fewer than k candidates, as faiss pads."""
    if metric is MetricType.HAMMING and allowed is None:
        params: Any = _FAISS.SearchParametersIVF()
        params.nprobe = nprobe
        found, positions = index.search(queries, k, params=params)
        return np.asarray(found, dtype=np.float32), np.asarray(positions)
    return probed_search(index, queries, k, nprobe, metric, allowed)


def probed_search(
    index: Any, queries: np.ndarray, k: int, nprobe: int, metric: MetricType, allowed: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The IVF search of `ivf_search` computed here: each query's `nprobe` nearest lists
    (faiss's quantizer), every allowed vector of them ranked by `metric`."""
    nprobe = min(nprobe, index.nlist)
    _, lists = index.quantizer.search(queries, nprobe)
    contents: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out_distances = np.full((len(queries), k), np.inf, dtype=np.float32)
    out_positions = np.full((len(queries), k), -1, dtype=np.int64)
    for q, probed in enumerate(lists):
        codes, ids = _candidates(index, [int(n) for n in probed if n >= 0], contents)
        if allowed is not None:
            keep = allowed[ids]
            codes, ids = codes[keep], ids[keep]
        if not len(ids):
            continue
        found, best = nearest(queries[q : q + 1], codes, metric, k)
        out_distances[q, : best.shape[1]] = found[0]
        out_positions[q, : best.shape[1]] = ids[best[0]]
    return out_distances, out_positions


def _candidates(
    index: Any, probed: list[int], contents: dict[int, tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """The codes and ids of the probed lists (each list read once per search)."""
    for n in probed:
        if n not in contents:
            contents[n] = _list(index, n)
    codes = [contents[n][0] for n in probed]
    ids = [contents[n][1] for n in probed]
    if not codes:
        return np.empty((0, index.code_size), dtype=np.uint8), np.empty(0, dtype=np.int64)
    return np.concatenate(codes), np.concatenate(ids)


def _list(index: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    lists = index.invlists
    size = lists.list_size(n)
    if not size:
        return np.empty((0, index.code_size), dtype=np.uint8), np.empty(0, dtype=np.int64)
    codes = faiss.rev_swig_ptr(lists.get_codes(n), size * index.code_size)
    ids = faiss.rev_swig_ptr(lists.get_ids(n), size)
    return (
        np.array(codes, dtype=np.uint8).reshape(size, index.code_size),
        np.array(ids, dtype=np.int64),
    )
