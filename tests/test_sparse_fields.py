"""Sparse float vectors on their way in (insert and import), and their inverted index
against a scipy reference: no etcd, no Spark."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import scipy.sparse as sp

from vchan_assets import fields
from vchan_assets.imports.files import ImportInputError, check_type, convert_column
from vchan_assets.indexes import sparse
from vchan_assets.model import CollectionSchema, DataType, FieldSchema

FIELD = FieldSchema(101, "sv", DataType.SPARSE_FLOAT_VECTOR)


def test_the_spec_sparse_float_vector_makes_a_field_without_dim_stored_as_a_map() -> None:
    schema = CollectionSchema.build("pk", {"sv": "sparse_float_vector"}, {})
    field = schema.field("sv")
    assert field.is_sparse and field.is_vector and field.dim is None
    assert field.spec == "sparse_float_vector"
    assert field.to_dict() == {
        "field_id": 101,
        "name": "sv",
        "dtype": "sparse_float_vector",
        "is_primary": False,
    }
    assert FieldSchema.from_dict(field.to_dict()) == field
    assert fields.arrow_type(field) == pa.map_(pa.int64(), pa.field("value", pa.float32(), nullable=False))


def test_a_sparse_field_refuses_a_dim_and_nulls() -> None:
    with pytest.raises(ValueError, match="has no dim"):
        FieldSchema(1, "sv", DataType.SPARSE_FLOAT_VECTOR, dim=8).validate()
    with pytest.raises(ValueError, match="cannot be nullable"):
        FieldSchema(1, "sv", DataType.SPARSE_FLOAT_VECTOR, nullable=True).validate()


def test_dicts_are_sorted_pairs_and_scipy_rows_are_taken_as_given_and_empty_rows_kept() -> None:
    given = [{9: 0.5, 2: 1.5}, {}, ([1, 4], [0.25, 2.0])]
    assert fields.sparse_array(given).to_pylist() == [[(2, 1.5), (9, 0.5)], [], [(1, 0.25), (4, 2.0)]]
    matrix = sp.csr_array(np.array([[0, 1.5, 0, 2.0], [0, 0, 0, 0]], dtype=np.float32))
    assert fields.sparse_array(matrix).to_pylist() == [[(1, 1.5), (3, 2.0)], []]


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        ([{1: 1.0}, ([3, 2], [1.0, 1.0])], "has index 2 after 3: indices must be strictly increasing"),
        ([{1: 1.0}, ([2, 2], [1.0, 1.0])], "has index 2 after 2"),
        ([{1: 1.0}, {-1: 1.0}], r"has index -1 outside \[0, 4294967295\)"),
        ([{1: 1.0}, {2**32 - 1: 1.0}], "has index 4294967295 outside"),
        ([{1: 1.0}, {1: float("nan")}], "has value nan"),
        ([{1: 1.0}, {1: 1e39}], "has value inf"),  # beyond float32
        ([{1: 1.0}, None], "is null"),
        ([{1: 1.0}, {"a": 1.0}], "not integers"),
        ([{1: 1.0}, 3.0], "is float: a sparse vector is a dict"),
    ],
)
def test_a_bad_sparse_row_is_refused_naming_the_row(given: list, reason: str) -> None:
    with pytest.raises(fields.FieldValueError, match=rf"{reason}.*\(row 1\)"):
        fields.sparse_array(given)


def test_an_import_reads_maps_structs_and_json_text_and_names_file_column_and_row() -> None:
    as_map = pa.array([[(1, 0.5)], [(3, 1.0), (7, 2.0)]], pa.map_(pa.int32(), pa.float64()))
    as_struct = pa.array([{"indices": [1], "values": [0.5]}, {"indices": [3, 7], "values": [1.0, 2.0]}])
    as_json = pa.array(['{"1": 0.5}', '{"indices": [3, 7], "values": [1.0, 2.0]}'])
    for column in (as_map, as_struct, as_json):
        check_type(FIELD, column.type, "f.parquet")
        got = convert_column(FIELD, column, "f.parquet")
        assert got.to_pylist() == [[(1, 0.5)], [(3, 1.0), (7, 2.0)]]
    with pytest.raises(ImportInputError, match=r"f.jsonl.*'sv'.*has index 3 after 7:.*at row 11"):
        convert_column(
            FIELD, pa.array(['{"1": 0.5}', '{"indices": [7, 3], "values": [1, 2]}']), "f.jsonl", 10
        )
    with pytest.raises(ImportInputError, match="expected a sparse vector"):
        check_type(FIELD, pa.list_(pa.float32()), "f.parquet")


def test_the_inverted_index_scores_as_a_scipy_product_and_survives_its_file() -> None:
    rng = np.random.default_rng(1)
    column = fields.random_sparse(rng, 3000, vocabulary=500, nonzeros=15)
    rows = sparse.sparse_rows(column)
    queries = sparse.sparse_rows(fields.random_sparse(rng, 7, vocabulary=500, nonzeros=5))
    dense, dense_q = rows[:, :500].toarray(), queries[:, :500].toarray()
    index = sparse.InvertedIndex.from_bytes(sparse.InvertedIndex.of(rows).to_bytes())
    assert index.ntotal == 3000
    assert np.allclose(index.scores(queries).toarray(), dense_q @ dense.T, rtol=1e-5)
    allowed = np.arange(3000) % 2 == 0
    scores, positions = sparse.top_k(index.scores(queries), 5, allowed)
    for q in range(7):
        want = np.where(allowed, dense_q[q] @ dense.T, -np.inf)
        assert np.allclose(scores[q], np.sort(want)[::-1][:5], rtol=1e-5)
        assert allowed[positions[q]].all()


def test_a_wide_vocabulary_is_indexed_by_the_indices_present() -> None:
    rows = sparse.sparse_rows(fields.sparse_array([{5: 1.0, 4_000_000_000: 2.0}, {4_000_000_000: 0.5}]))
    index = sparse.InvertedIndex.of(rows)
    assert index.terms.tolist() == [5, 4_000_000_000]
    scores = index.scores(sparse.sparse_queries({4_000_000_000: 2.0, 7: 1.0}))
    assert scores.toarray().tolist() == [[4.0, 1.0]]


def test_a_drop_ratio_drops_the_smallest_magnitudes_of_each_row() -> None:
    rows = sparse.sparse_rows(fields.sparse_array([{1: 0.1, 2: -3.0, 3: 0.2, 4: 1.0}, {8: 1.0}]))
    kept = sparse.drop_small(rows, 0.5)
    assert fields.sparse_array(kept).to_pylist() == [[(2, -3.0), (4, 1.0)], [(8, 1.0)]]


def test_map_rows_in_any_order_are_sorted_as_dicts_and_a_repeated_index_refused() -> None:
    given = pa.array([[(5, 1.0), (2, 2.0)], [], [(1, 0.5)]], pa.map_(pa.int64(), pa.float32()))
    assert fields.sparse_array(given).to_pylist() == [[(2, 2.0), (5, 1.0)], [], [(1, 0.5)]]
    assert fields.sparse_array([[(9, 1.0), (3, 2.0)]]).to_pylist() == [[(3, 2.0), (9, 1.0)]]  # as Spark gives
    repeated = pa.array([[(1, 1.0)], [(4, 1.0), (3, 1.0), (4, 2.0)]], pa.map_(pa.int64(), pa.float32()))
    with pytest.raises(fields.FieldValueError, match=r"has index 4 after 4.*\(row 1\)"):
        fields.sparse_array(repeated)
