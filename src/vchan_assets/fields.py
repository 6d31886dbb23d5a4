"""Field values on their way in: each type as Arrow holds it, and the checks Milvus makes.

Inserts (`wal.producer`) and imports (`imports.files`) turn a user's column into the
log's column with `conform`: cast to the field's Arrow type, the default filled into
nulls, and a `FieldValueError` (with the row, when one row is at fault) for a value the
field refuses, as Milvus' proxy refuses it: an integer outside its type's range, a
VarChar over `max_length` bytes, an array over `max_capacity` elements or with a VarChar
element over `max_length`, text that is not JSON, a null in a field that is neither
nullable nor has a default.

How each type is stored (what pandas and Spark readers get):
  int8 ... int64, float, double, bool   the Arrow type of that width
  varchar(N), string                    string
  json                                  string: the value's JSON text (Spark reads it with
                                        `from_json`, pandas with `json.loads`)
  array(E, N)                           list<E's type>
  float_vector (dim)                    fixed_size_binary(dim * 4), little-endian float32
  float16_vector, bfloat16_vector       fixed_size_binary(dim * 2): IEEE half / bfloat16 (the
                                        upper half of a float32, rounded to nearest even)
  sparse_float_vector                   map<int64, float32>: a row's indices, sorted, and their
                                        values (pandas: a dict {index: value}, as
                                        `Catalog.read_collection` converts it; Spark:
                                        map<bigint, float>); `sparse_array` checks them
  binary_vector (dim bits)              fixed_size_binary(dim / 8): the bits packed as
                                        `numpy.packbits` packs them (first bit in a byte's
                                        high bit), as faiss's binary indexes take them
Dense vectors are read as float32 matrices (`decode_vectors`, float16 and bfloat16 widened);
binary vectors as (n, dim / 8) uint8 matrices (`decode_binary`), never as floats;
`vector_matrix` picks the one of a field.
A JSON value given as a Python object is written as `json.dumps` of it; a string is taken
as JSON text and must parse.
"""

from __future__ import annotations

import json
from typing import Any, TypeAlias

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.model import (
    INTEGER_RANGES,
    MAX_SPARSE_INDEX,
    TEXT_TYPES,
    DataType,
    FieldSchema,
)

_SCALAR_ARROW = {
    DataType.INT8: pa.int8(),
    DataType.INT16: pa.int16(),
    DataType.INT32: pa.int32(),
    DataType.INT64: pa.int64(),
    DataType.FLOAT: pa.float32(),
    DataType.DOUBLE: pa.float64(),
    DataType.BOOL: pa.bool_(),
    DataType.VARCHAR: pa.string(),
    DataType.STRING: pa.string(),
    DataType.JSON: pa.string(),
}


class FieldValueError(ValueError):
    """A column a field refuses; `row` is the first row at fault when one is (0-based in
    the column given)."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message if row is None else f"{message} (row {row})")
        self.reason = message
        self.row = row


def arrow_type(field: FieldSchema) -> pa.DataType:
    """The Arrow type the log and the binlogs hold the field's values in."""
    if field.is_sparse:
        return SPARSE_TYPE
    if field.is_vector:
        return pa.binary(field.vector_bytes)
    if field.dtype is DataType.ARRAY:
        assert field.element_type is not None
        return pa.list_(_SCALAR_ARROW[field.element_type])
    return _SCALAR_ARROW[field.dtype]


Column: TypeAlias = pa.Array | pa.ChunkedArray


def to_arrow(field: FieldSchema, raw: Any) -> Column:
    """A scalar field's values as given (an Arrow array, a NumPy array, a pandas Series or
    a Python sequence) as Arrow, not yet checked: `conform` does that."""
    if isinstance(raw, pa.Array | pa.ChunkedArray):
        return raw
    if field.dtype is DataType.JSON:
        return pa.array([_json_text(v) for v in raw], type=pa.string())
    try:
        return pa.array(raw, type=arrow_type(field), from_pandas=True)
    except pa.ArrowInvalid:  # out of the type's range: read as given, so `conform` names the row
        return pa.array(raw, from_pandas=True)


def _json_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


def conform(field: FieldSchema, column: Column) -> Column:
    """`column` as the field's log column: cast, checked against the field's limits, nulls
    filled with its default. FieldValueError for what the field refuses."""
    if field.dtype is DataType.JSON:
        column = _json_column(column)
    elif not column.type.equals(arrow_type(field)):
        if field.dtype in TEXT_TYPES and not _is_text(column.type):
            raise FieldValueError(f"is {column.type}, not text")  # as Milvus: no number is read as a VarChar
        column = _cast(field, column)
    _check_limits(field, column)
    return _fill_nulls(field, column)


def absent(field: FieldSchema, rows: int) -> Column:
    """The column of a field that inserted rows leave out: its default, or nulls when it is
    nullable. FieldValueError when it is neither."""
    if not field.nullable and field.default_value is None:
        raise FieldValueError("is missing (the field is not nullable and has no default value)")
    return conform(field, pa.nulls(rows, arrow_type(field)))


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)


def _cast(field: FieldSchema, column: Column) -> Column:
    try:
        return pc.cast(column, arrow_type(field))
    except pa.ArrowException as exc:
        row = _first_out_of_range(field, column)
        raise FieldValueError(f"cannot be read as {field.type_name}: {exc}", row) from None


def _first_out_of_range(field: FieldSchema, column: Column) -> int | None:
    kind = field.element_type if field.dtype is DataType.ARRAY else field.dtype
    if kind not in INTEGER_RANGES or not (
        pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
    ):
        return None
    low, high = INTEGER_RANGES[kind]
    return _first(pc.or_(pc.less(column, low), pc.greater(column, high)))


def _json_column(column: Column) -> Column:
    """JSON values as their text: strings must parse; other Arrow values (structs, lists,
    maps, numbers) are written as JSON."""
    if pa.types.is_null(column.type):
        return column.cast(pa.string())
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        for row, text in enumerate(column.to_pylist()):
            if text is not None:
                try:
                    json.loads(text)
                except json.JSONDecodeError as exc:
                    raise FieldValueError(f"is not JSON: {exc}", row) from None
        return column.cast(pa.string())
    return pa.array([_json_text(v) for v in column.to_pylist()], type=pa.string())


def _check_limits(field: FieldSchema, column: Column) -> None:
    limit = field.text_limit
    if field.dtype is DataType.ARRAY:
        assert field.max_capacity is not None
        row = _first(pc.greater(pc.list_value_length(column), field.max_capacity))
        if row is not None:
            found = pc.list_value_length(column)[row].as_py()
            raise FieldValueError(f"has {found} elements, over its max_capacity {field.max_capacity}", row)
        if limit is not None:
            over = _first(pc.greater(pc.binary_length(pc.list_flatten(column)), limit))
            if over is not None:
                row = pc.list_parent_indices(column)[over].as_py()
                raise FieldValueError(f"has an element over its max_length of {limit} bytes", row)
    elif limit is not None:
        row = _first(pc.greater(pc.binary_length(column), limit))
        if row is not None:
            found = pc.binary_length(column)[row].as_py()
            raise FieldValueError(f"is {found} bytes long, over its max_length of {limit}", row)


def _fill_nulls(field: FieldSchema, column: Column) -> Column:
    if not column.null_count:
        return column
    if field.default_value is not None:
        return pc.fill_null(column, pa.scalar(field.default, type=column.type))
    if field.nullable:
        return column
    raise FieldValueError(
        "is null, and the field is not nullable and has no default value", _first(column.is_null())
    )


def _first(mask: Column) -> int | None:
    """The index of the first true value of a bool array (nulls count as false), or None."""
    found = pc.index(mask.fill_null(False), True).as_py()
    return None if found < 0 else int(found)


def random_values(field: FieldSchema, rng: np.random.Generator, n: int) -> pa.Array:
    """`n` random values of a scalar field: for tests, benches and demos (text from a
    vocabulary of 100 words, as real tags)."""
    kind = field.dtype
    if kind in INTEGER_RANGES:
        high = min(INTEGER_RANGES[kind][1], 1_000_000)
        return pa.array(rng.integers(0, high, n), arrow_type(field))
    if kind in (DataType.FLOAT, DataType.DOUBLE):
        return pa.array(rng.random(n), arrow_type(field))
    if kind is DataType.BOOL:
        return pa.array(rng.random(n) < 0.5)
    if kind is DataType.JSON:
        return pa.array(
            [json.dumps({"rank": int(r), "even": bool(r % 2 == 0)}) for r in rng.integers(0, 100, n)]
        )
    if kind is DataType.ARRAY:
        assert field.element_type is not None and field.max_capacity is not None
        element = FieldSchema(0, "e", field.element_type, max_length=field.max_length)
        lengths = rng.integers(0, min(field.max_capacity, 4) + 1, n)
        values = random_values(element, rng, int(lengths.sum()))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), values)
    words = _words(field.name, field.text_limit or 64)
    return words.take(pa.array(rng.integers(0, len(words), n)))


def _words(name: str, limit: int) -> pa.Array:
    return pa.array([f"{name}_{i}"[-limit:] for i in range(100)])


def pack_dynamic(extra: dict[str, Any], given: Column | None = None) -> pa.Array:
    """The dynamic field's column: per row, a JSON object of the `extra` columns' non-null
    values (merged into the row's `given` object, if any); null when a row has none."""
    columns = {name: _python(values) for name, values in extra.items()}
    rows = len(next(iter(columns.values())))
    base: list[Any] = [None] * rows if given is None else given.to_pylist()
    out = []
    for row in range(rows):
        found = {name: values[row] for name, values in columns.items() if values[row] is not None}
        if base[row] is not None:
            found = {**json.loads(base[row]), **found}
        out.append(json.dumps(found) if found else None)
    return pa.array(out, pa.string())


def _python(values: Any) -> list[Any]:
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return values.to_pylist()
    if isinstance(values, np.ndarray):
        return values.tolist()
    return [v.tolist() if isinstance(v, np.ndarray | np.generic) else v for v in values]


# --- primary keys ----------------------------------------------------------------------

Pk: TypeAlias = int | str  # a primary key's value: int64 or VarChar


def pk_values(field: FieldSchema, pks: Any) -> pa.Array:
    """Primary keys as given (a sequence, a NumPy array or Arrow) as the pk's Arrow type;
    ValueError when one is not a key of that type."""
    if isinstance(pks, pa.ChunkedArray):
        pks = pks.combine_chunks()
    if not isinstance(pks, pa.Array) and not len(pks):
        return pa.array([], arrow_type(field))
    try:
        found = (
            pks
            if isinstance(pks, pa.Array)
            else pa.array(np.asarray(pks) if field.dtype is DataType.INT64 else list(pks))
        )
        if found.type.equals(arrow_type(field)):
            return found
        if field.dtype is DataType.INT64 and not (
            pa.types.is_integer(found.type) or pa.types.is_null(found.type)
        ):
            raise TypeError(f"{found.type}")
        if field.dtype is not DataType.INT64 and not (
            pa.types.is_string(found.type) or pa.types.is_null(found.type)
        ):
            raise TypeError(f"{found.type}")
        return found.cast(arrow_type(field))
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise ValueError(f"primary keys of {field.name!r} must be {field.type_name}: {exc}") from None


def varchar_pks(field: FieldSchema, numbers: np.ndarray) -> pa.Array:
    """Numbers as VarChar pks of `field`: zero-padded to 12 digits (or its max_length), so
    the text sorts as the numbers do."""
    width = min(12, field.max_length or 12)
    return pa.array([f"{n:0{width}d}" for n in numbers.tolist()], pa.string())


def key_array(pks: Any) -> np.ndarray:
    """Keys as NumPy: int64, or Python strings in an object array (VarChar keys compare and
    sort as text)."""
    found = np.asarray(pks if isinstance(pks, np.ndarray) else list(pks))
    return (
        found.astype(np.int64, copy=False) if found.dtype.kind in "iu" else found.astype(object, copy=False)
    )


def hash_keys(pks: Any) -> np.ndarray:
    """Primary keys as int64 keys for hashing: int64 pks as they are, VarChar pks by their
    64-bit SipHash (pandas' `hash_array`, a fixed key: the same in every process)."""
    found = _numpy(pks)
    if found.dtype.kind in "iu":
        return found.astype(np.int64, copy=False)
    if not len(found):
        return np.empty(0, dtype=np.int64)
    return pd.util.hash_array(found.astype(object, copy=False), categorize=False).view(np.int64)


def vchannel_index(pks: Any, k: int) -> np.ndarray:
    """Which of `k` vchannels each pk's rows and deletes go to: `pk % k` for an int64 pk,
    the key's hash `% k` for a VarChar pk (Milvus hashes both; int64 pks keep the rule
    their logs were written with)."""
    found = _numpy(pks)
    if found.dtype.kind in "iu":
        return np.mod(found.astype(np.int64, copy=False), k)
    return (hash_keys(found).view(np.uint64) % np.uint64(k)).astype(np.int64)


def _numpy(pks: Any) -> np.ndarray:
    if isinstance(pks, pa.ChunkedArray):
        return pks.to_numpy()
    if isinstance(pks, pa.Array):
        return pks.to_numpy(zero_copy_only=False)
    return np.asarray(pks)


# --- dense vectors -----------------------------------------------------------------------


def encode_vectors(field: FieldSchema, matrix: np.ndarray) -> pa.FixedSizeBinaryArray:
    """An (n, dim) matrix of floats as the field stores them: fixed_size_binary of dim
    little-endian float32, float16 or bfloat16 values (bfloat16 rounded to nearest even)."""
    assert field.dim is not None
    floats = np.ascontiguousarray(matrix, dtype="<f4")
    if field.dtype is DataType.FLOAT16_VECTOR:
        data = floats.astype("<f2")
    elif field.dtype is DataType.BFLOAT16_VECTOR:
        bits = floats.view("<u4")
        data = (
            (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        ).astype("<u2")
    else:
        data = floats
    return pa.FixedSizeBinaryArray.from_buffers(
        arrow_type(field), floats.shape[0], [None, pa.py_buffer(data)]
    )


def decode_vectors(field: FieldSchema, column: Column) -> np.ndarray:
    """The field's vectors (fixed_size_binary as stored) as an (n, dim) float32 matrix,
    without Python rows (a null vector reads as whatever its bytes hold: zeros). Dense
    vectors only: binary vectors are bytes (`decode_binary`)."""
    assert field.dim is not None
    if field.is_binary_vector:
        raise ValueError(f"field {field.name!r} holds binary vectors: they are read as bytes, not floats")
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    width = field.vector_bytes // field.dim
    data = arr.buffers()[1]
    if not data or not len(arr):
        return np.empty((0, field.dim), dtype="<f4")
    start = arr.offset * field.dim
    count = start + len(arr) * field.dim
    if field.dtype is DataType.FLOAT_VECTOR:
        return np.frombuffer(data, dtype="<f4", count=count)[start:].reshape(len(arr), field.dim)
    if field.dtype is DataType.FLOAT16_VECTOR:
        values = np.frombuffer(data, dtype="<f2", count=count)[start:].astype("<f4")
    else:
        halves = np.frombuffer(data, dtype="<u2", count=count)[start:].astype("<u4")
        values = (halves << np.uint32(16)).view("<f4")
    assert width == 2
    return values.reshape(len(arr), field.dim)


# --- sparse vectors --------------------------------------------------------------------

# A sparse float vector per row: its indices (int64: Milvus' uint32 range, which Spark,
# without unsigned types, reads as bigint) and their float32 values, sorted by index.
# Values are not null (Spark's map<bigint, float> without null values); a column read back
# from Parquet names its entries after the column: `sparse_array` casts it back.
SPARSE_TYPE = pa.map_(pa.int64(), pa.field("value", pa.float32(), nullable=False))


def sparse_array(raw: Any) -> pa.MapArray:
    """Sparse vectors as given, one per row, as the field stores them (`SPARSE_TYPE`):
    a scipy.sparse matrix (its canonical form: indices sorted, duplicates summed, as scipy
    reads them); an Arrow map, or a list of {index: value} dicts or of lists of (index,
    value) items (a map's rows as Arrow or Spark give them), each sorted here (a map has
    no order to keep: Spark's does not keep one); or a list of (indices, values) pairs,
    whose indices must be strictly increasing. An empty row is kept (Milvus stores it; it
    matches no query).
    FieldValueError (with the row) for an unsorted or repeated index, an index outside
    [0, 2^32 - 1), a value that is not finite as float32, a null row."""
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks()
    if isinstance(raw, pa.MapArray):
        return _checked_sparse(_sorted_map(raw))
    if hasattr(raw, "tocsr"):  # a scipy.sparse matrix or array
        csr = raw.tocsr(copy=True)
        csr.sum_duplicates()
        return _checked_sparse(_map_of(csr.indptr, csr.indices, csr.data))
    if isinstance(raw, pa.Array):
        raw = raw.to_pylist()
    if isinstance(raw, dict):
        raise FieldValueError("is one {index: value} dict: give a list of them, one per row")
    offsets, indices, values = [0], [], []
    for row, vector in enumerate(raw):
        keys, found = _sparse_row(vector, row)
        indices.append(keys)
        values.append(found)
        offsets.append(offsets[-1] + len(keys))
    return _checked_sparse(
        _map_of(
            np.asarray(offsets),
            np.concatenate(indices) if indices else np.empty(0, np.int64),
            np.concatenate(values) if values else np.empty(0, np.float32),
        )
    )


def _sparse_row(vector: Any, row: int) -> tuple[np.ndarray, np.ndarray]:
    """One row's (indices, values): a dict's sorted by index, a pair's as given."""
    if vector is None:
        raise FieldValueError("is null (a sparse vector may be empty, not null)", row)
    if isinstance(vector, dict):
        items = sorted(vector.items())
    elif isinstance(vector, list) and all(isinstance(p, tuple) and len(p) == 2 for p in vector):
        items = sorted(vector)  # a map's rows as Arrow or Spark give them
    elif isinstance(vector, tuple | list) and len(vector) == 2:
        keys, found = (np.asarray(v) for v in vector)
        if keys.ndim != 1 or keys.shape != found.shape:
            raise FieldValueError("has indices and values of different lengths", row)
        return _indices(keys, row), found
    else:
        raise FieldValueError(
            f"is {type(vector).__name__}: a sparse vector is a dict {{index: value}} or (indices, values)",
            row,
        )
    keys = np.asarray([k for k, _ in items])
    return _indices(keys, row), np.asarray([v for _, v in items])


def _indices(keys: np.ndarray, row: int) -> np.ndarray:
    if len(keys) and keys.dtype.kind not in "iu":
        raise FieldValueError(f"has indices of type {keys.dtype}, not integers", row)
    if keys.dtype.kind == "u" and len(keys) and keys.max() > np.iinfo(np.int64).max:
        raise FieldValueError(f"has index {keys.max()} outside [0, {MAX_SPARSE_INDEX})", row)
    return keys.astype(np.int64)


def _map_of(offsets: np.ndarray, indices: np.ndarray, values: np.ndarray) -> pa.MapArray:
    try:
        with np.errstate(over="ignore"):  # a float64 beyond float32 becomes inf: refused as such
            floats = np.asarray(values).astype(np.float32)
    except (TypeError, ValueError) as exc:
        raise FieldValueError(f"has values that are not numbers: {exc}") from None
    return pa.MapArray.from_arrays(
        pa.array(np.asarray(offsets, dtype=np.int32)),
        pa.array(np.asarray(indices, dtype=np.int64)),
        pa.array(floats, pa.float32()),
        type=SPARSE_TYPE,
    )


def _sorted_map(column: pa.MapArray) -> pa.MapArray:
    """A map column with each row's entries sorted by index (as given when they are: the
    stored form). A repeated index stays for `_checked_sparse` to refuse."""
    if column.null_count:
        return column
    offsets, indices, values = sparse_buffers(column)
    ordered = np.diff(indices) > 0
    starts = offsets[1:-1][offsets[1:-1] < len(indices)]
    ordered[starts[starts > 0] - 1] = True  # (a row's first index follows another row's last)
    if ordered.all():
        return column
    owner = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    order = np.lexsort((indices, owner))
    return _map_of(offsets, indices[order], values[order])


def _checked_sparse(column: pa.MapArray) -> pa.MapArray:
    if not column.type.equals(SPARSE_TYPE):
        try:
            column = column.cast(SPARSE_TYPE)
        except pa.ArrowException as exc:
            raise FieldValueError(f"cannot be read as {SPARSE_TYPE}: {exc}") from None
    if column.null_count:
        raise FieldValueError("is null (a sparse vector may be empty, not null)", _first(column.is_null()))
    offsets, indices, values = sparse_buffers(column)

    def row_of(position: int) -> int:
        return int(np.searchsorted(offsets, position, side="right")) - 1

    bad = np.flatnonzero((indices < 0) | (indices >= MAX_SPARSE_INDEX))
    if len(bad):
        raise FieldValueError(f"has index {indices[bad[0]]} outside [0, {MAX_SPARSE_INDEX})", row_of(bad[0]))
    bad = np.flatnonzero(~np.isfinite(values))
    if len(bad):
        raise FieldValueError(f"has value {values[bad[0]]} (NaN or infinite as float32)", row_of(bad[0]))
    starts = np.zeros(len(indices), dtype=bool)
    starts[offsets[:-1][offsets[:-1] < len(indices)]] = True
    bad = np.flatnonzero((np.diff(indices, prepend=-1) <= 0) & ~starts)
    if len(bad):
        at = int(bad[0])
        raise FieldValueError(
            f"has index {indices[at]} after {indices[at - 1]}: indices must be strictly increasing "
            "(unsorted or repeated)",
            row_of(at),
        )
    return column


def sparse_buffers(column: Column) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sparse column's CSR parts without Python rows: row offsets (int64, from 0), indices
    (int64) and values (float32)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not len(arr):
        return np.zeros(1, np.int64), np.empty(0, np.int64), np.empty(0, np.float32)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    first, last = int(offsets[0]), int(offsets[-1])
    indices = arr.keys.to_numpy()[first:last]  # (the whole child: offsets say where this slice is)
    values = arr.items.to_numpy(zero_copy_only=False)[first:last]  # a null value: NaN, refused
    return offsets - first, indices.astype(np.int64, copy=False), values.astype(np.float32, copy=False)


def random_sparse(
    rng: np.random.Generator, n: int, vocabulary: int = 30_000, nonzeros: int = 20
) -> pa.MapArray:
    """`n` random sparse rows of about `nonzeros` indices of a `vocabulary` (Zipf-like: low
    indices are frequent, as a text model's tokens): for tests, benches and demos."""
    weights = 1.0 / np.arange(1, vocabulary + 1) ** 0.8
    drawn = rng.choice(vocabulary, size=(n, nonzeros), p=weights / weights.sum())
    drawn.sort(axis=1)
    keep = np.ones_like(drawn, dtype=bool)
    keep[:, 1:] = drawn[:, 1:] != drawn[:, :-1]
    lengths = keep.sum(axis=1)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = rng.random(int(offsets[-1]), dtype=np.float32) + np.float32(0.01)
    return _map_of(offsets, drawn[keep], values)


# --- binary vectors ----------------------------------------------------------------------


def binary_matrix(field: FieldSchema, raw: Any) -> np.ndarray:
    """Binary vectors as given (an (n, dim / 8) uint8 matrix of packed bits, an (n, dim)
    bool matrix of bits, packed by `numpy.packbits`, or a sequence of `bytes` of dim / 8
    each) as a C-contiguous (n, dim / 8) uint8 matrix; FieldValueError naming the shape,
    or the row at fault. Integers other than uint8 are refused: they could be bits or bytes."""
    assert field.dim is not None
    width = field.vector_bytes
    if isinstance(raw, pa.ChunkedArray | pa.Array):
        raw = raw.to_pylist()
    if not isinstance(raw, np.ndarray) and len(raw) and isinstance(raw[0], bytes | bytearray):
        wrong = next(
            (row for row, v in enumerate(raw) if not isinstance(v, bytes | bytearray) or len(v) != width),
            None,
        )
        if wrong is not None:
            found = raw[wrong]
            what = f"{len(found)} bytes" if isinstance(found, bytes | bytearray) else type(found).__name__
            raise FieldValueError(f"a binary vector of dim {field.dim} is {width} bytes, got {what}", wrong)
        return np.frombuffer(b"".join(raw), dtype=np.uint8).reshape(len(raw), width)
    matrix = np.asarray(raw)
    if matrix.dtype == np.bool_ and matrix.ndim == 2 and matrix.shape[1] == field.dim:
        return np.packbits(matrix, axis=1)
    if matrix.dtype != np.uint8 or matrix.ndim != 2 or matrix.shape[1] != width:
        raise FieldValueError(
            f"binary vectors of dim {field.dim} are an (n, {width}) uint8 matrix "
            f"of packed bits or an (n, {field.dim}) bool matrix, got {matrix.dtype} of shape {matrix.shape}"
        )
    return np.ascontiguousarray(matrix)


def encode_binary(field: FieldSchema, matrix: np.ndarray) -> pa.FixedSizeBinaryArray:
    """An (n, dim / 8) uint8 matrix of packed bits as the field stores it:
    fixed_size_binary(dim / 8), byte for byte."""
    data = binary_matrix(field, matrix)
    return pa.FixedSizeBinaryArray.from_buffers(arrow_type(field), len(data), [None, pa.py_buffer(data)])


def decode_binary(field: FieldSchema, column: Column) -> np.ndarray:
    """The field's binary vectors (fixed_size_binary(dim / 8) as stored) as an
    (n, dim / 8) uint8 matrix, without Python rows."""
    assert field.is_binary_vector
    width = field.vector_bytes
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    data = arr.buffers()[1]
    if not data or not len(arr):
        return np.empty((0, width), dtype=np.uint8)
    start = arr.offset * width
    return np.frombuffer(data, dtype=np.uint8, count=start + len(arr) * width)[start:].reshape(
        len(arr), width
    )


def vector_matrix(field: FieldSchema, column: Column) -> np.ndarray:
    """The field's stored vectors as faiss takes them: (n, dim / 8) uint8 for binary
    vectors, (n, dim) float32 for dense ones."""
    return decode_binary(field, column) if field.is_binary_vector else decode_vectors(field, column)
