"""Input files of an import: finding them, reading them in batches, and turning their
columns into the collection's (pure pyarrow; runs in the driver and in Spark tasks).

Formats: Parquet, JSON lines (one object per line) and CSV (a header row; vectors as
JSON arrays such as "[0.1, 0.2]"), through pyarrow's readers, streamed batch by batch.

Column rules, checked against the collection schema before anything is written:
  - the primary key and every vector field must be present; a missing scalar field gets
    its default value, or null when it is nullable, in every row (else the job fails);
  - a column the schema does not know fails the job, unless asked to drop such columns or
    the collection has a dynamic field (which then keeps them, as JSON);
  - types must fit: integers from any integer type (in the field's range), float/double
    from integers or floats, varchar from strings (within `max_length` bytes), bool from
    bools, JSON from JSON text or nested values, an array from lists (or, in CSV, JSON
    arrays); a vector from fixed_size_list / list of numbers or fixed_size_binary(dim * 4),
    with exactly the field's dimension; a binary vector (dim bits) from binary values of
    dim / 8 bytes (packed bits) or lists of dim / 8 integers in [0, 255] (JSON and CSV); a
    sparse vector from a map<integer, number>, a struct of `indices` and `values` lists, or
    (JSON lines, CSV) JSON text of either form ({"3": 0.5, "17": 0.1} or {"indices": [3,
    17], "values": [0.5, 0.1]}), its indices checked as an insert checks them
    (`fields.sparse_array`);
  - the primary key and vectors have no nulls; another field's nulls take its default, and
    are refused (naming the row) when it is neither nullable nor has a default.
Every violation is an `ImportInputError` naming the file and the column.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.fs as pafs
import pyarrow.json as pjson
import pyarrow.parquet as pq

from vchan_assets import fields
from vchan_assets.errors import DeclaredError
from vchan_assets.imports.jobs import ImportFormat
from vchan_assets.model import TEXT_TYPES, CollectionSchema, DataType, FieldSchema
from vchan_assets.storage.fs import filesystem_for

BATCH_ROWS = 64 * 1024
SUFFIXES = {
    ImportFormat.PARQUET: (".parquet", ".parq"),
    ImportFormat.JSON: (".json", ".jsonl", ".ndjson"),
    ImportFormat.CSV: (".csv",),
}


class ImportInputError(DeclaredError, ValueError):
    """An input file does not fit the collection; names the file and, where one is at
    fault, the column. Picklable: a Spark task raises it and the driver gets it back."""

    path: str
    reason: str
    column: str | None = None

    def __str__(self) -> str:
        where = f"{self.path}: column {self.column!r}" if self.column else self.path
        return f"{where}: {self.reason}"


@dataclass(frozen=True)
class FileSource:
    """Where input paths are read from: local paths, or s3://bucket/key through the
    configured S3 endpoint. Picklable into Spark tasks."""

    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"

    def resolve(self, path: str) -> tuple[pafs.FileSystem, str]:
        return filesystem_for(path, self.s3_endpoint, self.s3_region)

    def size(self, path: str) -> int:
        fs, inner = self.resolve(path)
        info = fs.get_file_info(inner)
        if info.type != pafs.FileType.File:
            raise ImportInputError(path, "does not exist (or is not a file)")
        return int(info.size or 0)

    def expand(self, paths: list[str], fmt: ImportFormat) -> list[str]:
        """Files named, and the files of the format under directories named (sorted)."""
        out: list[str] = []
        for path in paths:
            fs, inner = self.resolve(path)
            info = fs.get_file_info(inner)
            if info.type == pafs.FileType.Directory:
                found = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
                names = sorted(
                    i.path for i in found if i.type == pafs.FileType.File and i.path.endswith(SUFFIXES[fmt])
                )
                if not names:
                    raise ImportInputError(path, f"directory holds no {fmt} files")
                prefix = "s3://" if path.startswith("s3://") else ""
                out += [prefix + n for n in names]
            elif info.type == pafs.FileType.File:
                out.append(path)
            else:
                raise ImportInputError(path, "does not exist")
        return out


# --- reading -------------------------------------------------------------------------------


def parquet_file(source: FileSource, path: str) -> pq.ParquetFile:
    fs, inner = source.resolve(path)
    try:
        return pq.ParquetFile(fs.open_input_file(inner))
    except FileNotFoundError:
        raise ImportInputError(path, "does not exist") from None
    except (OSError, pa.ArrowException) as exc:
        raise ImportInputError(path, f"is not a readable Parquet file ({exc})") from None


def file_schema(source: FileSource, path: str, fmt: ImportFormat) -> pa.Schema:
    if fmt is ImportFormat.PARQUET:
        return parquet_file(source, path).schema_arrow
    return next(iter(read_batches(source, path, fmt))).schema


def read_batches(
    source: FileSource,
    path: str,
    fmt: ImportFormat,
    columns: list[str] | None = None,
    row_groups: tuple[int, ...] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The file's rows batch by batch (only `columns`, and only `row_groups` of a
    Parquet file, if given); ImportInputError naming the file when it cannot be read."""
    try:
        yield from _batches(source, path, fmt, columns, row_groups)
    except ImportInputError:
        raise
    except FileNotFoundError:
        raise ImportInputError(path, "does not exist (it disappeared after pre-import?)") from None
    except (OSError, pa.ArrowException) as exc:
        raise ImportInputError(path, f"cannot be read as {fmt}: {exc}") from None


def _batches(
    source: FileSource,
    path: str,
    fmt: ImportFormat,
    columns: list[str] | None,
    row_groups: tuple[int, ...] | None,
) -> Iterator[pa.RecordBatch]:
    if fmt is ImportFormat.PARQUET:
        pf = parquet_file(source, path)
        groups = range(pf.num_row_groups) if row_groups is None else row_groups
        # One row group at a time: a reader given them all reads ahead and holds the whole
        # file in memory (measured), so memory would grow with the rows of a file.
        for group in groups:
            yield from pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=columns)
        return
    fs, inner = source.resolve(path)
    with fs.open_input_stream(inner) as stream:
        reader = pjson.open_json(stream) if fmt is ImportFormat.JSON else pcsv.open_csv(stream)
        for batch in reader:
            yield batch.select(columns) if columns is not None else batch


# --- columns -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ColumnPlan:
    """How a file's columns become the collection's: which to read, which to drop,
    which fields are missing (null)."""

    read: tuple[str, ...]
    dropped: tuple[str, ...]
    missing: tuple[str, ...]


def plan_columns(schema: CollectionSchema, found: pa.Schema, path: str, drop_unknown: bool) -> ColumnPlan:
    names = set(found.names)
    known = {f.name for f in schema.fields}
    unknown = tuple(n for n in found.names if n not in known)
    if unknown and not drop_unknown and schema.dynamic_field is None:
        raise ImportInputError(path, "is not a field of the collection (or drop unknown columns)", unknown[0])
    missing = []
    for f in schema.fields:
        if f.name not in names:
            if f.is_primary or f.is_vector:
                raise ImportInputError(
                    path, f"is missing ({'primary key' if f.is_primary else 'vector'})", f.name
                )
            if not f.nullable and f.default_value is None:
                raise ImportInputError(path, "is missing (not nullable, and no default value)", f.name)
            missing.append(f.name)
            continue
        check_type(f, found.field(f.name).type, path)
    return ColumnPlan(tuple(n for n in found.names if n in known), unknown, tuple(missing))


def check_type(field: FieldSchema, found: pa.DataType, path: str) -> None:
    """The column's type can hold the field's values (vector dims checked when fixed)."""
    if field.is_sparse:
        if not _holds_sparse(found):
            raise ImportInputError(
                path,
                f"is {found}, expected a sparse vector (map<int64, float>, or indices and values)",
                field.name,
            )
        return
    if field.is_vector:
        _check_vector_type(field, found, path)
        return
    if not (_fits(field, found) or (pa.types.is_null(found) and not field.is_primary)):
        raise ImportInputError(path, f"is {found}, expected {field.type_name}", field.name)


def _fits(field: FieldSchema, found: pa.DataType) -> bool:
    text = pa.types.is_string(found) or pa.types.is_large_string(found)
    kind = field.dtype
    if kind is DataType.JSON:
        return True  # JSON text, or nested values written as JSON
    if kind is DataType.ARRAY:
        listed = (
            pa.types.is_list(found) or pa.types.is_large_list(found) or pa.types.is_fixed_size_list(found)
        )
        assert field.element_type is not None
        element = FieldSchema(0, "element", field.element_type, max_length=field.max_length)
        return text or (listed and (_fits(element, found.value_type) or pa.types.is_null(found.value_type)))
    if kind in (DataType.FLOAT, DataType.DOUBLE):
        return pa.types.is_integer(found) or pa.types.is_floating(found)
    if kind is DataType.BOOL:
        return pa.types.is_boolean(found)
    if kind in TEXT_TYPES:
        return text
    return pa.types.is_integer(found)


def _holds_sparse(found: pa.DataType) -> bool:
    if pa.types.is_map(found):
        return pa.types.is_integer(found.key_type) and (
            pa.types.is_floating(found.item_type) or pa.types.is_integer(found.item_type)
        )
    if pa.types.is_struct(found):
        return {found.field(i).name for i in range(found.num_fields)} == {"indices", "values"}
    return pa.types.is_string(found) or pa.types.is_large_string(found) or pa.types.is_null(found)


def _check_vector_type(field: FieldSchema, found: pa.DataType, path: str) -> None:
    dim = field.dim
    assert dim is not None
    if field.is_binary_vector and (pa.types.is_binary(found) or pa.types.is_large_binary(found)):
        return  # each value's length is checked per batch
    if pa.types.is_fixed_size_binary(found):
        width = fields.arrow_type(field).byte_width
        if found.byte_width != width:
            raise ImportInputError(
                path, f"holds {found.byte_width}-byte vectors, expected {width} (dim {dim})", field.name
            )
        return
    if pa.types.is_fixed_size_list(found) or pa.types.is_list(found) or pa.types.is_large_list(found):
        value = found.value_type
        if field.is_binary_vector:
            if not (pa.types.is_integer(value) or pa.types.is_null(value)):
                raise ImportInputError(
                    path, f"is {found}, expected a binary vector's bytes as integers", field.name
                )
            if pa.types.is_fixed_size_list(found) and found.list_size != field.vector_bytes:
                raise ImportInputError(
                    path,
                    f"has {found.list_size} bytes a vector, expected {field.vector_bytes} (dim {dim} bits)",
                    field.name,
                )
            return
        if not (pa.types.is_floating(value) or pa.types.is_integer(value) or pa.types.is_null(value)):
            raise ImportInputError(path, f"is {found}, expected a vector of floats", field.name)
        if pa.types.is_fixed_size_list(found) and found.list_size != dim:
            raise ImportInputError(path, f"has dimension {found.list_size}, expected {dim}", field.name)
        return
    if pa.types.is_string(found) or pa.types.is_large_string(found):
        return  # CSV: JSON arrays, parsed per batch
    raise ImportInputError(path, f"is {found}, expected a {field.type_name}", field.name)


def convert(schema: CollectionSchema, batch: pa.RecordBatch, path: str, first_row: int = 0) -> pa.Table:
    """A batch as the collection's fields in log order (pk first): scalars cast, missing
    scalars their default or null, vectors as fixed_size_binary(dim * 4) little-endian
    float32; columns the schema lacks in its dynamic field, when it has one."""
    names = set(batch.schema.names)
    ordered = [schema.primary] + [f for f in schema.fields if not f.is_primary]
    columns = [
        convert_column(f, batch.column(f.name), path, first_row)
        if f.name in names
        else fields.absent(f, batch.num_rows)
        for f in ordered
    ]
    dynamic = schema.dynamic_field
    extra = [n for n in batch.schema.names if n not in {f.name for f in ordered}]
    if dynamic is not None and extra:
        at = ordered.index(dynamic)
        try:
            columns[at] = fields.pack_dynamic({n: batch.column(n) for n in extra}, columns[at])
        except (TypeError, ValueError) as exc:
            raise ImportInputError(path, f"cannot hold the columns {extra}: {exc}", dynamic.name) from None
    return pa.Table.from_arrays(columns, names=[f.name for f in ordered])


def convert_column(f: FieldSchema, raw: pa.Array, path: str, first_row: int = 0) -> pa.Array:
    """One column as the field's log type; ImportInputError naming the file, the column
    and the first bad row."""
    if f.is_sparse:
        return _sparse(f, raw, path, first_row)
    return _vector(f, raw, path, first_row) if f.is_vector else _scalar(f, raw, path, first_row)


def _first_null(column: pa.Array) -> int:
    return int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])


def _scalar(f: FieldSchema, raw: pa.Array, path: str, first_row: int) -> pa.Array:
    if f.is_primary and raw.null_count:
        raise ImportInputError(path, f"is null at row {first_row + _first_null(raw)}", f.name)
    if f.dtype is DataType.ARRAY and (pa.types.is_string(raw.type) or pa.types.is_large_string(raw.type)):
        raw = _parse_json_lists(f, raw, path, first_row)
    try:
        return fields.conform(f, raw)
    except fields.FieldValueError as exc:
        at = "" if exc.row is None else f" at row {first_row + exc.row}"
        raise ImportInputError(path, f"{exc.reason}{at}", f.name) from None


def _parse_json_lists(f: FieldSchema, raw: pa.Array, path: str, first_row: int) -> pa.Array:
    """CSV arrays: '[1, 2]' or '["a", "b"]' -> lists of the element type."""
    parsed = []
    for row, text in enumerate(raw.to_pylist()):
        try:
            value = None if text is None else json.loads(text)
        except json.JSONDecodeError:
            value = text
        if value is not None and not isinstance(value, list):
            raise ImportInputError(path, f"is not a JSON array at row {first_row + row}", f.name)
        parsed.append(value)
    try:
        return pa.array(parsed, type=fields.arrow_type(f))
    except (pa.ArrowException, TypeError) as exc:
        raise ImportInputError(path, f"holds an array that is not {f.type_name}: {exc}", f.name) from None


def _vector(f: FieldSchema, raw: pa.Array, path: str, first_row: int) -> pa.Array:
    dim = f.dim
    assert dim is not None
    if raw.null_count:
        raise ImportInputError(path, f"has a null vector at row {first_row + _first_null(raw)}", f.name)
    target = fields.arrow_type(f)
    if raw.type.equals(target):
        return raw
    if pa.types.is_string(raw.type) or pa.types.is_large_string(raw.type):
        raw = _parse_json_arrays(f, raw, path)
    if f.is_binary_vector:
        return _binary(f, raw, path, first_row)
    values = _list_values(
        f, raw, dim, path, first_row, "has dimension {found} at row {row}, expected {wanted}"
    )
    matrix = np.ascontiguousarray(values.to_numpy(zero_copy_only=False), dtype="<f4")
    return fields.encode_vectors(f, matrix.reshape(len(raw), dim))


def _list_values(
    f: FieldSchema, raw: pa.Array, wanted: int, path: str, first_row: int, says: str
) -> pa.Array:
    """The values of a list column whose every list has `wanted` values; ImportInputError
    naming the first row that has not (`says`, with {found}, {row} and {wanted})."""
    lengths = pc.list_value_length(raw).to_numpy(zero_copy_only=False)
    wrong = np.flatnonzero(lengths != wanted)
    if len(wrong):
        row = int(wrong[0])
        raise ImportInputError(
            path, says.format(found=int(lengths[row]), row=first_row + row, wanted=wanted), f.name
        )
    values = pc.list_flatten(raw)
    if values.null_count:
        raise ImportInputError(path, "has a null inside a vector", f.name)
    return values


def _binary(f: FieldSchema, raw: pa.Array, path: str, first_row: int) -> pa.Array:
    """Binary vectors from binary values (packed bits) or lists of byte values."""
    width = f.vector_bytes
    shown = f"{{found}} bytes at row {{row}}, expected {{wanted}} (dim {f.dim} bits)"
    if (
        pa.types.is_binary(raw.type)
        or pa.types.is_large_binary(raw.type)
        or pa.types.is_fixed_size_binary(raw.type)
    ):
        lengths = pc.binary_length(raw).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != width)
        if len(wrong):
            row = int(wrong[0])
            raise ImportInputError(
                path,
                "has " + shown.format(found=int(lengths[row]), row=first_row + row, wanted=width),
                f.name,
            )
        return pc.cast(raw, fields.arrow_type(f))
    values = _list_values(f, raw, width, path, first_row, "has " + shown)
    numbers = values.to_numpy(zero_copy_only=False)
    bad = np.flatnonzero((numbers < 0) | (numbers > 255) | (numbers != np.floor(numbers)))
    if len(bad):
        row = first_row + int(bad[0]) // width
        raise ImportInputError(
            path, f"holds {numbers[bad[0]]} at row {row}: a byte is an integer in [0, 255]", f.name
        )
    return fields.encode_binary(f, numbers.astype(np.uint8).reshape(len(raw), width))


def _sparse(f: FieldSchema, raw: pa.Array, path: str, first_row: int) -> pa.Array:
    if raw.null_count:
        raise ImportInputError(path, f"has a null vector at row {first_row + _first_null(raw)}", f.name)
    try:
        if pa.types.is_struct(raw.type):
            rows: object = list(
                zip(raw.field("indices").to_pylist(), raw.field("values").to_pylist(), strict=True)
            )
        elif pa.types.is_string(raw.type) or pa.types.is_large_string(raw.type):
            rows = [_sparse_json(text, row) for row, text in enumerate(raw.to_pylist())]
        else:
            rows = raw
        return fields.sparse_array(rows)
    except fields.FieldValueError as exc:
        at = "" if exc.row is None else f" at row {first_row + exc.row}"
        raise ImportInputError(path, f"{exc.reason}{at}", f.name) from None


def _sparse_json(text: str, row: int) -> object:
    """A sparse vector's JSON text: {"3": 0.5} or {"indices": [3], "values": [0.5]}."""
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        raise fields.FieldValueError("is not JSON", row) from None
    if not isinstance(found, dict):
        raise fields.FieldValueError("is not a JSON object", row)
    if set(found) == {"indices", "values"}:
        return (found["indices"], found["values"])
    try:
        return {int(k): v for k, v in found.items()}
    except ValueError:
        raise fields.FieldValueError("has a key that is not an integer index", row) from None


def _parse_json_arrays(f: FieldSchema, raw: pa.Array, path: str) -> pa.Array:
    """CSV vectors: "[0.1, 0.2]" -> list<float32>."""
    inner = pc.utf8_trim(pc.utf8_trim_whitespace(raw), "[]")
    parts = pc.split_pattern(inner, ",")
    try:
        values = pc.cast(pc.utf8_trim_whitespace(pc.list_flatten(parts)), pa.float32())
    except pa.ArrowException as exc:
        raise ImportInputError(
            path, f"holds a vector that is not a JSON array of numbers: {exc}", f.name
        ) from None
    offsets = parts.offsets
    return pa.ListArray.from_arrays(offsets, values)
