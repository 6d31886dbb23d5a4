"""What `format("vchan")`'s batch reader (`query.spark_source`) and change stream
(`query.stream_source`) share: their common options (collection, fields, vectors, ...),
checked once, and the Spark types of a collection's fields."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
)
from pyspark.sql.types import (
    DataType as SparkType,
)

from vchan_assets.config import Settings
from vchan_assets.fields import SPARSE_TYPE, decode_vectors
from vchan_assets.model import CollectionInfo, DataType, FieldSchema
from vchan_assets.query.prune import Pushdown, parse_where
from vchan_assets.storage.rows import float_vectors

VECTOR_MODES = ("array", "binary")
TASK_MB = 128.0

_SCALARS: dict[DataType, SparkType] = {
    DataType.INT8: ByteType(),
    DataType.INT16: ShortType(),
    DataType.INT32: IntegerType(),
    DataType.INT64: LongType(),
    DataType.FLOAT: FloatType(),
    DataType.DOUBLE: DoubleType(),
    DataType.BOOL: BooleanType(),
    DataType.VARCHAR: StringType(),
    DataType.STRING: StringType(),
    DataType.JSON: StringType(),  # the JSON text: `from_json` reads it
}


class ReadOptionError(ValueError):
    """A `format("vchan")` option is missing or wrong; the message names it."""


@dataclass(frozen=True)
class ReadRequest:
    """The options of one read, checked."""

    collection: str
    partitions: tuple[str, ...] = ()
    segments: tuple[int, ...] = ()
    fields: tuple[str, ...] = ()
    vectors: str = "array"
    task_mb: float = TASK_MB
    as_of: str = ""  # empty: now
    where: tuple[tuple[str, str, Any], ...] = ()  # (option, op, text) of pks, pk_min, pk_max

    def pushdown(self, info: CollectionInfo) -> Pushdown:
        """The pk conditions of the options on this collection's primary key (the options'
        text read as int64 or VarChar keys, as the pk is)."""
        pk = info.schema.primary
        return parse_where(
            info, [(pk.name, op, _typed(pk, option, op, text)) for option, op, text in self.where]
        )

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ReadRequest:
        opts = {k.lower(): v for k, v in options.items()}
        collection = opts.get("collection", "").strip()
        if not collection:
            raise ReadOptionError('format("vchan") needs .option("collection", NAME)')
        vectors = opts.get("vectors", "array").strip().lower()
        if vectors not in VECTOR_MODES:
            raise ReadOptionError(f"option vectors={vectors!r}: expected one of {', '.join(VECTOR_MODES)}")
        try:
            segments = tuple(int(s) for s in _names(opts.get("segments", "")))
        except ValueError as exc:
            raise ReadOptionError(f"option segments={opts['segments']!r}: expected segment ids") from exc
        task_mb = opts.get("task_mb", str(TASK_MB))
        try:
            mb = float(task_mb)
        except ValueError:
            mb = -1.0
        if not mb >= 0:  # also NaN
            raise ReadOptionError(f"option task_mb={task_mb!r}: expected megabytes >= 0")
        return cls(
            collection,
            _names(opts.get("partition", "")),
            segments,
            _names(opts.get("fields", "")),
            vectors,
            mb,
            opts.get("as_of", "").strip(),
            _pk_conditions(opts),
        )


def _pk_conditions(opts: Mapping[str, str]) -> tuple[tuple[str, str, Any], ...]:
    """`pks` (comma-separated), `pk_min` and `pk_max` (both included) as (option, op, text)."""
    out: list[tuple[str, str, Any]] = []
    for option, op in (("pks", "in"), ("pk_min", ">="), ("pk_max", "<=")):
        raw = opts.get(option, "").strip()
        if not raw:
            continue
        values = _names(raw)
        if op != "in" and len(values) != 1:
            raise ReadOptionError(f"option {option}={raw!r}: expected one primary key")
        out.append((option, op, values if op == "in" else values[0]))
    return tuple(out)


def _typed(pk: FieldSchema, option: str, op: str, text: Any) -> Any:
    if pk.dtype is not DataType.INT64:
        return list(text) if op == "in" else text
    try:
        return [int(v) for v in text] if op == "in" else int(text)
    except ValueError:
        shown = ",".join(text) if op == "in" else text
        raise ReadOptionError(f"option {option}={shown!r}: expected integer primary keys") from None


def _names(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def settings_from_options(options: Mapping[str, str]) -> Settings:
    """The worker's environment, overridden by options named like VCHAN_* variables."""
    overrides = {k.upper(): v for k, v in options.items() if k.upper().startswith("VCHAN_")}
    return Settings.from_env({**os.environ, **overrides})


def spark_type(field: FieldSchema, vectors: str) -> SparkType:
    if field.is_sparse:  # map<bigint, float> whatever `vectors` asks: it is neither binary nor dense
        return MapType(LongType(), FloatType(), valueContainsNull=False)
    if field.is_vector:
        as_floats = vectors == "array" and not field.is_binary_vector  # binary vectors: their bytes
        return ArrayType(FloatType(), containsNull=False) if as_floats else BinaryType()
    if field.dtype is DataType.ARRAY:
        assert field.element_type is not None
        return ArrayType(_SCALARS[field.element_type])
    return _SCALARS[field.dtype]


def selected_fields(info: CollectionInfo, request: ReadRequest) -> list[FieldSchema]:
    """The user fields to read in the binlogs' order: primary key (always read: deletes
    need it), the scalars, then the vectors (their column groups follow the scalar one)."""
    rest = [f for f in info.schema.fields if not f.is_primary]
    ordered = [info.schema.primary] + [f for f in rest if not f.is_vector] + [f for f in rest if f.is_vector]
    if not request.fields:
        return ordered
    known = {f.name for f in ordered}
    unknown = [name for name in request.fields if name not in known]
    if unknown:
        raise ReadOptionError(
            f"collection {info.name!r} has no field {', '.join(map(repr, unknown))}; fields: {sorted(known)}"
        )
    return [f for f in ordered if f.is_primary or f.name in request.fields]


def vectors_as_lists(
    column: pa.Array | pa.ChunkedArray, dim: int, field: FieldSchema | None = None
) -> pa.Array:
    """Stored vectors (fixed_size_binary: little-endian float32, or `field`'s float16 or
    bfloat16) -> list<float32>, without Python rows."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    floats = (float_vectors(arr, dim) if field is None else decode_vectors(field, arr)).reshape(-1)
    mask = arr.is_null() if arr.null_count else None
    lists = pa.FixedSizeListArray.from_arrays(pa.array(floats, pa.float32()), dim, mask=mask)
    return lists.cast(pa.list_(pa.field("element", pa.float32(), nullable=False)))


def field_column(
    column: pa.Array | pa.ChunkedArray, field: FieldSchema, vectors: str
) -> pa.Array | pa.ChunkedArray:
    """A field's column (as binlogs and the log hold it) as the Spark schema expects it:
    vectors as lists of floats or plain binary (`vectors`; binary vectors always as their
    packed bytes), the rest (sparse vectors too: map<int64, float32>) as it is."""
    if field.is_sparse:
        return column.cast(SPARSE_TYPE)  # (entries named as Spark's map, not after the column)
    if not field.is_vector:
        return column
    if field.is_binary_vector:
        return column.cast(pa.binary())
    assert field.dim is not None
    return vectors_as_lists(column, field.dim, field) if vectors == "array" else column.cast(pa.binary())
