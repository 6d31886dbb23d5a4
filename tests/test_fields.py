"""Milvus' scalar types: how a schema names them, how Arrow holds them, and what an insert
or an import refuses (no etcd: the schema codec and `fields.conform`)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets import fields
from vchan_assets.datanode.stats import PkStats
from vchan_assets.fields import FieldValueError
from vchan_assets.meta.codec import decode, encode
from vchan_assets.model import CollectionSchema, DataType, FieldSchema
from vchan_assets.query.prune import FilterError, pk_condition
from vchan_assets.wal.producer import generate_rows, to_insert_table

EVERY_SCALAR = {
    "i8": "int8",
    "i16": "int16",
    "i32": "int32?",
    "i64": "int64=7",
    "f": "float=0.5",
    "d": "double?",
    "b": "bool=true",
    "name": "varchar(8)=none",
    "s": "string",
    "meta": "json?",
    "tags": "array(varchar(4), 3)",
    "ranks": "array(int16, 2)?",
}
SCHEMA = CollectionSchema.build("pk", {"vec": 4}, EVERY_SCALAR)


def field(spec: str) -> FieldSchema:
    made = FieldSchema.from_spec(100, "x", spec)
    made.validate()
    return made


def test_every_spec_reads_back_as_written_and_survives_the_codec() -> None:
    for name, spec in EVERY_SCALAR.items():
        assert SCHEMA.field(name).spec == spec.replace("=none", '="none"')
    assert decode("k", encode(SCHEMA), CollectionSchema) == SCHEMA
    assert SCHEMA.field("tags").element_type is DataType.VARCHAR and SCHEMA.field("tags").max_capacity == 3


def test_a_schema_of_the_old_six_types_is_stored_exactly_as_before() -> None:
    old = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "s": "string"})
    stored = json.loads(encode(old))["fields"]
    assert stored[3] == {"field_id": 103, "name": "s", "dtype": "string", "is_primary": False}
    assert old.field("s").text_limit == 65_535


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("varchar", "expected varchar(MAX_LENGTH)"),
        ("varchar(65536)", "max_length must be in [1, 65535]"),
        ("array(json, 3)", "an array holds one of"),
        ("array(int8, 4097)", "max_capacity must be in [1, 4096]"),
        ("array(int8)", "expected array(ELEMENT, MAX_CAPACITY)"),
        ("int8=300", "default value 300 is not a int8"),
        ("bool=1", "default value 1 is not a bool"),
        ("varchar(2)=abc", "is not a varchar(2)"),
        ("json={}", "is not a json"),
        ("int64(3)", "takes no parameters"),
        ("decimal", "unknown type 'decimal'"),
        ("int32 nullable", "expected TYPE[?][=DEFAULT]"),
    ],
)
def test_a_bad_spec_is_refused_saying_why(spec: str, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        field(spec)
    assert says in str(caught.value)


def test_a_primary_key_or_a_vector_cannot_be_nullable() -> None:
    with pytest.raises(ValueError, match="cannot be nullable"):
        FieldSchema(100, "pk", DataType.INT64, is_primary=True, nullable=True).validate()
    with pytest.raises(ValueError, match="cannot be nullable"):
        FieldSchema(101, "v", DataType.FLOAT_VECTOR, dim=4, default_value="1").validate()


def test_each_type_has_its_arrow_width() -> None:
    got = {name: str(fields.arrow_type(SCHEMA.field(name))) for name in EVERY_SCALAR}
    assert got == {
        "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "f": "float", "d": "double",
        "b": "bool", "name": "string", "s": "string", "meta": "string", "tags": "list<item: string>",
        "ranks": "list<item: int16>",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "values", "says", "row"),
    [
        ("int8", [1, 300, 2], "cannot be read as int8", 1),
        ("int16", [-40000], "cannot be read as int16", 0),
        ("varchar(3)", ["abc", "héé"], "is 5 bytes long, over its max_length of 3", 1),
        ("array(int32, 2)", [[1], [1, 2, 3]], "has 3 elements, over its max_capacity 2", 1),
        ("array(varchar(2), 5)", [["ab"], [], ["a", "abc"]], "has an element over its max_length of 2", 2),
        ("json", pa.array(['{"a": 1}', "{nope"]), "is not JSON", 1),
        ("float", [0.5, None], "is null, and the field is not nullable and has no default value", 1),
    ],
)
def test_a_value_the_field_refuses_is_named_with_its_row(
    spec: str, values: object, says: str, row: int
) -> None:
    f = field(spec)
    with pytest.raises(FieldValueError) as caught:
        fields.conform(f, fields.to_arrow(f, values))
    assert says in caught.value.reason and caught.value.row == row


def test_nulls_take_the_default_and_a_nullable_field_keeps_them() -> None:
    assert fields.conform(field("int32=5"), pa.array([1, None], pa.int64())).to_pylist() == [1, 5]
    assert fields.conform(field("varchar(4)?"), pa.array(["a", None])).to_pylist() == ["a", None]
    assert fields.absent(field("bool=false"), 2).to_pylist() == [False, False]
    with pytest.raises(FieldValueError, match="is missing"):
        fields.absent(field("double"), 2)


def test_json_values_are_stored_as_their_text() -> None:
    f = field("json?")
    got = fields.conform(f, fields.to_arrow(f, [{"color": "red", "n": [1, 2]}, None, "[1, 2]", 3]))
    assert got.type == pa.string()
    assert [None if v is None else json.loads(v) for v in got.to_pylist()] == [
        {"color": "red", "n": [1, 2]}, None, [1, 2], 3,
    ]  # fmt: skip


def test_an_insert_may_leave_out_the_fields_that_are_nullable_or_have_a_default() -> None:
    rows = generate_rows(SCHEMA, 3, seed=1)
    table = to_insert_table(SCHEMA, {n: rows[n] for n in ("pk", "vec", "i8", "i16", "name", "s", "tags")})
    assert table["i64"].to_pylist() == [7, 7, 7] and table["b"].to_pylist() == [True] * 3
    assert table["i32"].null_count == 3 and table["meta"].null_count == 3
    assert table.schema.names == [f.name for f in SCHEMA.fields]
    with pytest.raises(ValueError, match=r"missing \['i8'\]"):
        to_insert_table(SCHEMA, {n: rows[n] for n in ("pk", "vec", "i16", "name", "s", "tags")})


def test_an_insert_names_the_field_and_the_row_it_refuses() -> None:
    rows = generate_rows(SCHEMA, 3, seed=1)
    names = rows["name"].to_pylist()
    rows = rows.set_column(
        rows.schema.get_field_index("name"), "name", pa.array([*names[:2], "far too long"])
    )
    with pytest.raises(
        ValueError, match=r"field 'name': is 12 bytes long, over its max_length of 8 \(row 2\)"
    ):
        to_insert_table(SCHEMA, rows)


def test_generated_rows_fit_every_type() -> None:
    rows = generate_rows(SCHEMA, 200, seed=3)
    table = to_insert_table(SCHEMA, rows)
    assert table.num_rows == 200
    assert all(len(tags) <= 3 and all(len(t) <= 4 for t in tags) for tags in table["tags"].to_pylist())
    assert all(isinstance(json.loads(v), dict) for v in table["meta"].to_pylist())


# --- VarChar primary keys ----------------------------------------------------------------


def test_a_primary_key_is_int64_or_varchar() -> None:
    schema = CollectionSchema.build("doc", {"vec": 4}, {}, pk_type="varchar(36)")
    assert schema.primary.dtype is DataType.VARCHAR and schema.primary.max_length == 36
    with pytest.raises(ValueError, match=r"must be int64 or varchar\(N\), not float"):
        CollectionSchema.build("doc", {"vec": 4}, {}, pk_type="float")
    with pytest.raises(ValueError, match="cannot be nullable"):
        CollectionSchema.build("doc", {"vec": 4}, {}, pk_type="varchar(8)?")


def test_a_varchar_key_goes_to_the_same_vchannel_in_every_process_and_release() -> None:
    # Pinned: a change of the hash would send a key's new rows and deletes to another
    # vchannel than its old rows, and a delete would miss them.
    keys = [f"doc-{i}" for i in range(1, 9)]
    assert fields.vchannel_index(keys, 4).tolist() == [3, 1, 3, 0, 0, 2, 1, 2]
    assert fields.hash_keys(pa.array(["doc-1"])).tolist() == [-2571354538640969989]
    assert fields.vchannel_index(pa.array(keys), 4).tolist() == fields.vchannel_index(keys, 4).tolist()
    assert fields.vchannel_index(np.array([5, -3, 8]), 4).tolist() == [1, 1, 0]  # int64: pk % K, as ever


def test_stats_of_varchar_keys_bound_and_filter_them() -> None:
    keys = np.array([f"k{i:05d}" for i in range(3000)], dtype=object)
    stats = PkStats.from_bytes(PkStats.build(keys).to_bytes())
    assert (stats.pk_min, stats.pk_max) == ("k00000", "k02999")
    assert stats.might_contain(keys).all()
    others = np.array([f"z{i}" for i in range(1000)] + [f"k{i:05d}x" for i in range(1000)], dtype=object)
    assert stats.might_contain(others).mean() < 0.01
    assert not PkStats.build(np.array([], dtype=object)).might_contain(keys[:3]).any()


def test_a_pk_filter_compares_varchar_keys_as_text() -> None:
    table = pa.table({"doc": ["a", "b", "c", "d"]})
    between = pk_condition(">", "a", text=True).and_(pk_condition("<=", "c", text=True))
    assert between.rows(table, "doc", is_sorted=True)["doc"].to_pylist() == ["b", "c"]
    assert between.rows(table, "doc")["doc"].to_pylist() == ["b", "c"]
    picked = pk_condition("in", ["d", "a", "q"], text=True)
    assert picked.rows(table, "doc")["doc"].to_pylist() == ["a", "d"]
    assert pk_condition("=", "e", text=True).and_(between).empty
    with pytest.raises(FilterError, match="is not a VarChar primary key"):
        pk_condition("=", 3, text=True)


# --- the dynamic field -------------------------------------------------------------------


def test_the_keys_a_schema_lacks_go_to_the_dynamic_field_as_json() -> None:
    schema = CollectionSchema.build("pk", {"vec": 4}, {"n": "int64"}, dynamic=True)
    assert schema.dynamic_field is not None and schema.dynamic_field.name == "$meta"
    assert decode("k", encode(schema), CollectionSchema) == schema
    rows = generate_rows(CollectionSchema.build("pk", {"vec": 4}, {"n": "int64"}), 3)
    extra = {"color": ["red", None, "blue"], "size": np.array([1, 2, 3])}
    table = to_insert_table(schema, {**{n: rows[n] for n in rows.column_names}, **extra})
    assert [json.loads(v) for v in table["$meta"].to_pylist()] == [
        {"color": "red", "size": 1}, {"size": 2}, {"color": "blue", "size": 3},
    ]  # fmt: skip
    plain = to_insert_table(schema, {n: rows[n] for n in rows.column_names})
    assert plain["$meta"].null_count == 3
    with pytest.raises(ValueError, match=r"unknown \['color'\]"):
        to_insert_table(
            CollectionSchema.build("pk", {"vec": 4}, {"n": "int64"}), {**rows.to_pydict(), "color": ["a"] * 3}
        )


# --- float16 and bfloat16 vectors --------------------------------------------------------


def test_half_vectors_store_two_bytes_a_value_and_read_back_as_float32() -> None:
    schema = CollectionSchema.build("pk", {"h": "float16_vector(4)", "b": "bfloat16_vector(4)"}, {})
    h, b = schema.field("h"), schema.field("b")
    assert (h.spec, fields.arrow_type(h), fields.arrow_type(b)) == (
        "float16_vector(4)",
        pa.binary(8),
        pa.binary(8),
    )
    matrix = np.random.default_rng(0).random((50, 4), dtype=np.float32)
    for field, tolerance in ((h, 1e-3), (b, 1e-2)):
        back = fields.decode_vectors(field, fields.encode_vectors(field, matrix))
        assert back.dtype == np.float32 and np.allclose(back, matrix, rtol=tolerance, atol=tolerance)
    assert schema.row_bytes() == 16 + 8 + 8 + 8


def test_bfloat16_rounds_to_nearest_even() -> None:
    b = FieldSchema.from_spec(100, "b", "bfloat16_vector(3)")
    bits = np.array([[0x3F808000, 0x3F818000, 0x3F80C000]], dtype="<u4")  # two halfway cases, one above
    stored = np.frombuffer(fields.encode_vectors(b, bits.view("<f4")).buffers()[1], dtype="<u2")[:3]
    assert stored.tolist() == [0x3F80, 0x3F82, 0x3F81]
