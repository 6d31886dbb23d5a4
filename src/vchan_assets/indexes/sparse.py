"""Sparse float vectors as scipy.sparse matrices, and the inverted index Milvus builds on
them (SPARSE_INVERTED_INDEX; SPARSE_WAND searches the same lists).

A segment's index is its vectors transposed: for each index (a "term") present in the
segment, the rows holding it and their values (a posting list) — the CSR matrix of the
transposed rows, `postings` (terms x rows). A search maps the query's indices onto the
segment's terms (those the segment lacks score nothing) and multiplies: Q @ postings is
the (queries x rows) matrix of inner products, computed over the posting lists of the
query's terms only (scipy's sparse product). A row that shares no index with a query,
or whose products sum to zero, is no candidate. Exact search builds the same matrix from
the rows it reads, so an index without drop ratios returns exactly what exact search does.

scipy.sparse was measured against an inverted index in numpy (posting lists gathered with
np.concatenate, scores with np.bincount): at 100,000 rows of 150 indices of a 30,000
vocabulary, 100 queries of 30 indices, scipy's product and a top-k per query took 0.58 s,
numpy's 1.75 s (BENCHMARKS.md, sparse index).

The index file (`index_files/{build}/{version}/index.sparse.npz`) holds the terms, the
postings' CSR buffers and the row count as NumPy arrays (`np.savez`, no pickle).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from vchan_assets.fields import SPARSE_TYPE, Column, sparse_array, sparse_buffers
from vchan_assets.model import MAX_SPARSE_INDEX, FieldSchema, SegmentInfo
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import segment_column

if TYPE_CHECKING:
    import scipy.sparse as sp

SPARSE_INDEX_FILE = "index.sparse.npz"


def engine_version() -> str:
    import scipy

    return f"scipy-{scipy.__version__}"


def _csr(arg: Any, shape: tuple[int, ...] | None = None) -> sp.csr_array:
    """scipy.sparse's CSR array of `arg` (`(data, indices, indptr)` or a matrix). scipy is
    imported at the first one: every Dagster code server and run worker imports this module
    with the definitions, and scipy.sparse would add 0.15 CPU s to each start."""
    from scipy.sparse import csr_array

    return csr_array(arg, shape=shape)


def sparse_rows(column: Column) -> sp.csr_array:
    """A sparse column (as stored) as an (n, 2^32 - 1) CSR matrix, without Python rows."""
    offsets, indices, values = sparse_buffers(column)
    return _csr((values, indices, offsets), (len(offsets) - 1, MAX_SPARSE_INDEX))


def segment_rows(storage: Storage, seg: SegmentInfo, field: FieldSchema) -> sp.csr_array:
    """A sparse field's rows of an L1 segment, in its row order (its own column group)."""
    column = segment_column(storage, seg, field)
    return sparse_rows(column if column is not None else pa.array([], SPARSE_TYPE))


def sparse_queries(raw: Any) -> sp.csr_array:
    """Query vectors as given (what an insert takes: dicts, (indices, values) pairs, a
    scipy matrix; one dict is one query), checked as a field's values are
    (`fields.sparse_array`: FieldValueError naming the query)."""
    return sparse_rows(sparse_array([raw] if isinstance(raw, dict) else raw))


def drop_small(rows: sp.csr_array, ratio: float) -> sp.csr_array:
    """Each row without its floor(ratio * n) values of least magnitude (of its n): Milvus'
    drop ratio. Indices stay sorted."""
    lengths = np.diff(rows.indptr)
    if not ratio or not rows.nnz:
        return rows
    owner = np.repeat(np.arange(len(lengths)), lengths)
    order = np.lexsort((np.abs(rows.data), owner))  # by row, then magnitude
    rank = np.empty(rows.nnz, dtype=np.int64)
    rank[order] = np.arange(rows.nnz) - np.repeat(rows.indptr[:-1], lengths)
    keep = rank >= np.floor(ratio * lengths).astype(np.int64)[owner]
    kept = np.concatenate([[0], np.cumsum(keep)])[rows.indptr]
    return _csr((rows.data[keep], rows.indices[keep], kept), rows.shape)


@dataclass(frozen=True)
class InvertedIndex:
    """A segment's posting lists: `postings` row t holds the segment's rows having index
    `terms[t]` and their values (terms sorted)."""

    terms: np.ndarray  # int64, sorted, unique
    postings: sp.csr_array  # (len(terms), rows) float32

    @property
    def ntotal(self) -> int:
        """The rows indexed (the segment's, in its row order)."""
        return int(self.postings.shape[1])

    @classmethod
    def of(cls, rows: sp.csr_array, drop_ratio: float = 0.0) -> InvertedIndex:
        """The index of `rows` (an (n, 2^32 - 1) CSR matrix), each row first without its
        `drop_ratio` smallest values. A vocabulary about as wide as the rows' values are
        many is taken whole (every index up to the largest: no sort); a wider one only
        with the indices present."""
        rows = drop_small(rows, drop_ratio)
        top = int(rows.indices.max()) + 1 if rows.nnz else 0
        if top <= max(4 * rows.nnz, 1 << 16):
            terms, columns = np.arange(top, dtype=np.int64), rows.indices
        else:
            terms, columns = np.unique(rows.indices, return_inverse=True)
        # int32 positions when they fit (the rows' 2^32 - 1 columns made them int64): half
        # the file and memory, and scipy's product runs on int32 indices
        kind = np.int32 if max(len(terms), rows.shape[0], rows.nnz) < 2**31 else np.int64
        compact = _csr(
            (rows.data, columns.astype(kind), rows.indptr.astype(kind)), (rows.shape[0], len(terms))
        )
        postings = _csr(compact.T)  # CSC of the rows = CSR of their transpose
        return cls(terms.astype(np.int64), postings)

    def scores(self, queries: sp.csr_array) -> sp.csr_array:
        """The inner products of each query with the indexed rows, (queries x rows),
        computed over the posting lists of the query's indices."""
        position = np.searchsorted(self.terms, queries.indices)
        inside = position < len(self.terms)
        inside[inside] = self.terms[position[inside]] == queries.indices[inside]
        kept = np.concatenate([[0], np.cumsum(inside)])[queries.indptr]
        kind = self.postings.indices.dtype
        mapped = _csr(
            (queries.data[inside], position[inside].astype(kind), kept.astype(kind)),
            (queries.shape[0], len(self.terms)),
        )
        return _csr(mapped @ self.postings)

    def to_bytes(self) -> bytes:
        out = io.BytesIO()
        p = self.postings
        np.savez(
            out, terms=self.terms, indptr=p.indptr, rows=p.indices, values=p.data, shape=np.array(p.shape)
        )
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> InvertedIndex:
        """The index of a file (ValueError or OSError when it is not one)."""
        with np.load(io.BytesIO(data), allow_pickle=False) as found:
            shape = tuple(int(x) for x in found["shape"])
            postings = _csr((found["values"], found["rows"], found["indptr"]), shape)
            return cls(found["terms"], postings)


def top_k(scores: sp.csr_array, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k largest scores per query among the `allowed` rows (None: all), as (nq, k)
    scores and row positions, padded with -1 positions when a query has fewer."""
    nq = scores.shape[0]
    distances = np.zeros((nq, k), dtype=np.float32)
    positions = np.full((nq, k), -1, dtype=np.int64)
    for q in range(nq):
        start, end = scores.indptr[q], scores.indptr[q + 1]
        rows, found = scores.indices[start:end], scores.data[start:end]
        if allowed is not None:
            keep = allowed[rows]
            rows, found = rows[keep], found[keep]
        take = min(k, len(found))
        if not take:
            continue
        best = np.argpartition(-found, take - 1)[:take]
        best = best[np.argsort(-found[best], kind="stable")]
        distances[q, :take] = found[best]
        positions[q, :take] = rows[best]
    return distances, positions
