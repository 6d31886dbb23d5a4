"""Binary vectors as a schema declares them and the log holds them: dim in bits, stored as
fixed_size_binary(dim / 8) byte for byte, never widened to floats; what an insert refuses
(no etcd: the schema codec, `fields` and the producer's conversion)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets import fields
from vchan_assets.meta.codec import decode, encode
from vchan_assets.model import CollectionSchema, DataType, FieldSchema
from vchan_assets.wal.producer import generate_rows, to_insert_table

SCHEMA = CollectionSchema.build("pk", {"bits": "binary_vector(64)"}, {"n": "int64"})
BITS = SCHEMA.field("bits")


def packed(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 8), dtype=np.uint8)


def test_a_binary_vector_counts_bits_and_stores_a_byte_per_eight() -> None:
    assert (BITS.dtype, BITS.dim, BITS.spec, BITS.vector_bytes) == (
        DataType.BINARY_VECTOR,
        64,
        "binary_vector(64)",
        8,
    )
    assert fields.arrow_type(BITS) == pa.binary(8)
    assert SCHEMA.row_bytes() == 16 + 8 + 8 + 8  # row id and timestamp, pk, the 8 bytes of 64 bits, n
    assert decode("k", encode(SCHEMA), CollectionSchema) == SCHEMA


@pytest.mark.parametrize("dim", [0, 12, 65])
def test_a_binary_vector_dim_is_a_positive_multiple_of_8(dim: int) -> None:
    with pytest.raises(ValueError, match="dim"):
        FieldSchema.from_spec(100, "b", f"binary_vector({dim})").validate()


def test_binary_vectors_round_trip_byte_for_byte_and_are_not_read_as_floats() -> None:
    matrix = packed(50)
    column = fields.encode_binary(BITS, matrix)
    assert column.type == pa.binary(8) and column[3].as_py() == matrix[3].tobytes()
    back = fields.decode_binary(BITS, pa.chunked_array([column.slice(0, 20), column.slice(20)]))
    assert back.dtype == np.uint8 and np.array_equal(back, matrix)
    assert np.array_equal(fields.vector_matrix(BITS, column.slice(5)), matrix[5:])
    with pytest.raises(ValueError, match="binary vectors: they are read as bytes"):
        fields.decode_vectors(BITS, column)


def test_an_insert_takes_packed_bytes_bits_or_bytes_per_row() -> None:
    matrix = packed(4)
    bools = np.unpackbits(matrix, axis=1).astype(bool)
    for given in (matrix, bools, [row.tobytes() for row in matrix], fields.encode_binary(BITS, matrix)):
        table = to_insert_table(SCHEMA, {"pk": np.arange(4), "bits": given, "n": np.arange(4)})
        assert np.array_equal(fields.decode_binary(BITS, table["bits"]), matrix)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (
            np.zeros((3, 7), dtype=np.uint8),
            r"field 'bits': binary vectors of dim 64 are an \(n, 8\) uint8 matrix .* got uint8 of shape \(3, 7\)",
        ),
        (np.zeros((3, 8), dtype=np.float32), r"field 'bits': .* got float32 of shape \(3, 8\)"),
        (np.zeros((3, 63), dtype=bool), r"got bool of shape \(3, 63\)"),
        (
            [b"\0" * 8, b"\0" * 8, b"\0" * 9],
            r"field 'bits': a binary vector of dim 64 is 8 bytes, got 9 bytes \(row 2\)",
        ),
    ],
)
def test_an_insert_refuses_binary_vectors_of_the_wrong_width_naming_field_and_shape_or_row(
    given: object, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        to_insert_table(SCHEMA, {"pk": np.arange(3), "bits": given, "n": np.arange(3)})


def test_generated_rows_hold_random_binary_vectors() -> None:
    rows = generate_rows(SCHEMA, 100, seed=2)
    bits = fields.decode_binary(BITS, rows["bits"])
    assert bits.shape == (100, 8) and 0.4 < np.unpackbits(bits).mean() < 0.6
