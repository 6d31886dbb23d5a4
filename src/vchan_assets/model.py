"""The domain model: small immutable records and the one codec they all share.

Every record stored in etcd is a frozen dataclass deriving from `Record`, whose
`to_dict` / `from_dict` are generic over the dataclass fields and their type hints:
ints, floats, strings, bools, enums (by value), nested records, tuples of those and
`X | None`. `from_dict` checks every field's type, fills in a field's default when a
value written by an older version lacks it (so a field added with a default needs no
migration), runs the record's `validate()`, and raises
`ValueError` naming the field (with its path inside nested records). `meta.codec` adds
the schema version and turns that error into one that names the etcd key.

Why a small codec of our own and not pydantic: the records stay plain frozen
dataclasses (hashable, `replace`-able, cheap to pickle into Spark tasks), the domain
layers depend on nothing that comes only with Dagster, and the stored JSON is exactly
what the hand-written codec wrote before (tests/meta/test_stored_values.py).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any, ClassVar, Self

# --- the codec -------------------------------------------------------------------------


class Record:
    """Base of the stored records: one dict form for every dataclass field."""

    # Fields left out of the dict when they are None (as the records were always written).
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()
    # Fields left out when they hold their default: a field added later, so the values
    # that never set it are written exactly as before it existed.
    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.name in self.OMIT_WHEN_NONE:
                continue
            if f.name in self.OMIT_WHEN_DEFAULT and value == f.default:
                continue
            out[f.name] = _dump(value)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        hints = _hints(cls)
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            default = f.default if f.default is not dataclasses.MISSING else ...
            values[f.name] = _load(d, f.name, hints[f.name], default)
        record = cls(**values)
        record.validate()
        return record

    def validate(self) -> None:
        """Checks beyond the field types, run on decoding; raise ValueError."""


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_dump(v) for v in value]
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved field types of a record class (computed once per class)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _load(d: Mapping[str, Any], name: str, hint: Any, default: Any) -> Any:
    if _is_optional(hint):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        default = None if default is ... else default
    if d.get(name) is None:
        if default is ...:
            raise ValueError(f"missing field {name!r}")
        return default
    return _value(d[name], name, hint)


def _is_optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _value(raw: Any, name: str, hint: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        return _items(raw, name, typing.get_args(hint)[0])
    if isinstance(hint, type) and issubclass(hint, Record):
        if not isinstance(raw, dict):
            raise ValueError(f"field {name!r} must be an object, got {type(raw).__name__}")
        try:
            return hint.from_dict(raw)
        except ValueError as exc:
            raise ValueError(f"in {name}: {exc}") from None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _member(raw, name, hint)
    return _scalar(raw, name, hint)


def _items(raw: Any, name: str, item: Any) -> tuple[Any, ...]:
    if not isinstance(raw, list):
        raise ValueError(f"field {name!r} must be list, got {type(raw).__name__}")
    return tuple(_value(v, f"{name}[{i}]", item) for i, v in enumerate(raw))


def _member(raw: Any, name: str, kind: type[enum.Enum]) -> Any:
    try:
        return kind(_scalar(raw, name, str))
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ValueError(f"field {name!r} is {raw!r}, expected one of: {allowed}") from None


def _scalar(raw: Any, name: str, kind: type) -> Any:
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, bool) and kind is not bool:
        raise ValueError(f"field {name!r} must be {_type_name(kind)}, got bool")
    if not isinstance(raw, kind):
        raise ValueError(f"field {name!r} must be {_type_name(kind)}, got {type(raw).__name__}")
    return raw


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind)  # `int | float` has no __name__


# --- positions and timestamps ------------------------------------------------------------

LOGICAL_BITS = 18


def compose_ts(physical_ms: int, logical: int = 0) -> int:
    """Hybrid timestamp: physical milliseconds << 18 | logical counter (as Milvus' TSO)."""
    return (physical_ms << LOGICAL_BITS) | logical


def physical_ms(ts: int) -> int:
    return ts >> LOGICAL_BITS


@dataclass(frozen=True, order=True)
class MsgPosition(Record):
    """A position in a vchannel: the message at `offset` and its timestamp."""

    channel: str
    offset: int
    timestamp: int

    def validate(self) -> None:
        if self.offset < -1:
            raise ValueError(f"field 'offset' must be >= -1, got {self.offset}")


# --- schema and collections ------------------------------------------------------------


class DataType(enum.StrEnum):
    """A field's type, as Milvus names it; its value (the lower-case name) is what schemas store.

    `STRING` is what schemas held before `VARCHAR` existed: a VarChar of Milvus' largest
    `max_length` (65,535 bytes), stored under its old name so those values decode as written."""

    INT8 = enum.auto()
    INT16 = enum.auto()
    INT32 = enum.auto()
    INT64 = enum.auto()
    FLOAT = enum.auto()
    DOUBLE = enum.auto()
    BOOL = enum.auto()
    VARCHAR = enum.auto()
    STRING = enum.auto()
    JSON = enum.auto()
    ARRAY = enum.auto()
    FLOAT_VECTOR = enum.auto()
    FLOAT16_VECTOR = enum.auto()
    BFLOAT16_VECTOR = enum.auto()
    SPARSE_FLOAT_VECTOR = enum.auto()
    BINARY_VECTOR = enum.auto()


# Dense vectors and the bytes of one of their values (little-endian float32, IEEE half,
# bfloat16: the upper half of a float32), as Milvus stores them.
VECTOR_WIDTHS = {DataType.FLOAT_VECTOR: 4, DataType.FLOAT16_VECTOR: 2, DataType.BFLOAT16_VECTOR: 2}
# Every vector type: the dense ones, and binary vectors (`dim` bits, eight to a byte).
VECTOR_TYPES = frozenset(VECTOR_WIDTHS) | {DataType.BINARY_VECTOR}


# Milvus' name of the dynamic field: a JSON column of the inserted keys a schema does not have.
DYNAMIC_FIELD = "$meta"
INTEGER_TYPES = frozenset({DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64})
TEXT_TYPES = frozenset({DataType.VARCHAR, DataType.STRING})
# What an ARRAY may hold (Milvus: every scalar but JSON and ARRAY itself).
ELEMENT_TYPES = INTEGER_TYPES | {DataType.FLOAT, DataType.DOUBLE, DataType.BOOL, DataType.VARCHAR}
# Milvus' limits.
MAX_VARCHAR_LENGTH = 65_535
MAX_ARRAY_CAPACITY = 4_096
MAX_VECTOR_DIM = 32_768
# A sparse vector's indices are in [0, MAX_SPARSE_INDEX) (Milvus: uint32 but its largest).
MAX_SPARSE_INDEX = 2**32 - 1
INTEGER_RANGES = {
    DataType.INT8: (-(2**7), 2**7 - 1),
    DataType.INT16: (-(2**15), 2**15 - 1),
    DataType.INT32: (-(2**31), 2**31 - 1),
    DataType.INT64: (-(2**63), 2**63 - 1),
}


@dataclass(frozen=True)
class FieldSchema(Record):
    """One field of a collection. `max_length` bounds a VarChar's values (UTF-8 bytes, as
    Milvus counts them) and an array's VarChar elements; `element_type` and `max_capacity`
    make an ARRAY; a `nullable` field keeps nulls; `default_value` (JSON text) fills a
    field's nulls and its absence from inserted rows."""

    OMIT_WHEN_NONE = frozenset({"dim", "max_length", "element_type", "max_capacity", "default_value"})
    OMIT_WHEN_DEFAULT = frozenset({"nullable", "is_dynamic", "is_partition_key"})

    field_id: int
    name: str
    dtype: DataType
    is_primary: bool = False
    dim: int | None = None
    max_length: int | None = None
    element_type: DataType | None = None
    max_capacity: int | None = None
    nullable: bool = False
    default_value: str | None = None
    is_dynamic: bool = False  # the dynamic field `$meta`: the keys of inserted rows the schema lacks
    is_partition_key: bool = False  # its value's hash picks each row's (hidden) partition

    @property
    def is_vector(self) -> bool:
        return self.dtype in VECTOR_TYPES or self.is_sparse

    @property
    def is_sparse(self) -> bool:
        """A sparse float vector: no dim, per row indices and their values."""
        return self.dtype is DataType.SPARSE_FLOAT_VECTOR

    @property
    def is_binary_vector(self) -> bool:
        return self.dtype is DataType.BINARY_VECTOR

    @property
    def vector_bytes(self) -> int:
        """The bytes of one stored vector: dim values of its width, or dim / 8 for a
        binary vector (its dim counts bits); a sparse vector has no fixed size."""
        assert self.dtype in VECTOR_TYPES and self.dim is not None
        return self.dim // 8 if self.is_binary_vector else self.dim * VECTOR_WIDTHS[self.dtype]

    @property
    def text_limit(self) -> int | None:
        """The byte limit of this field's strings (its own or its elements'), if it has strings."""
        if self.dtype is DataType.STRING:
            return MAX_VARCHAR_LENGTH
        if self.dtype is DataType.VARCHAR or self.element_type is DataType.VARCHAR:
            return self.max_length
        return None

    @property
    def default(self) -> Any:
        """The default value as Python (None when the field has none)."""
        return None if self.default_value is None else json.loads(self.default_value)

    @property
    def type_name(self) -> str:
        """The type as `from_spec` reads it: `varchar(64)`, `array(int32, 8)`, `json`,
        `float16_vector(128)`, `sparse_float_vector`."""
        if self.dtype is DataType.VARCHAR:
            return f"varchar({self.max_length})"
        if self.dtype in VECTOR_TYPES:
            return f"{self.dtype.value}({self.dim})"
        if self.dtype is DataType.ARRAY:
            element = (
                f"varchar({self.max_length})" if self.element_type is DataType.VARCHAR else self.element_type
            )
            return f"array({element}, {self.max_capacity})"
        return self.dtype.value

    @property
    def spec(self) -> str:
        """The field's type, `?` when nullable and `=default`: what `from_spec` reads back."""
        nullable = "?" if self.nullable else ""
        default = "" if self.default_value is None else f"={self.default_value}"
        return f"{self.type_name}{nullable}{default}"

    @classmethod
    def from_spec(cls, field_id: int, name: str, spec: str) -> FieldSchema:
        """A scalar field from its text form: a type (`int8` ... `int64`, `float`, `double`,
        `bool`, `varchar(N)`, `string`, `json`, `array(ELEMENT, N)`), then `?` for nullable,
        then `=DEFAULT` (JSON; a VarChar's default may be a bare word). ValueError says what
        does not parse."""
        dtype, params, rest = _split_type(spec, name)
        nullable = rest.startswith("?")
        rest = rest[1:].strip() if nullable else rest
        default = None
        if rest:
            if not rest.startswith("="):
                raise ValueError(f"field {name!r}: cannot read {spec!r} (expected TYPE[?][=DEFAULT])")
            default = _default_json(rest[1:].strip(), dtype)
        kwargs: dict[str, Any] = {}
        if dtype is DataType.VARCHAR:
            kwargs["max_length"] = _one_int(params, name, "varchar(MAX_LENGTH)")
        elif dtype in VECTOR_TYPES:
            kwargs["dim"] = _one_int(params, name, f"{dtype.value}(DIM)")
        elif dtype is DataType.ARRAY:
            if len(params) != 2:
                raise ValueError(f"field {name!r}: expected array(ELEMENT, MAX_CAPACITY), got {spec!r}")
            element, element_params, tail = _split_type(params[0], name)
            if tail:
                raise ValueError(f"field {name!r}: cannot read the array element {params[0]!r}")
            kwargs["element_type"] = element
            if element is DataType.VARCHAR:
                kwargs["max_length"] = _one_int(element_params, name, "varchar(MAX_LENGTH)")
            kwargs["max_capacity"] = _one_int(params[1:], name, "array(ELEMENT, MAX_CAPACITY)")
        elif params:
            raise ValueError(f"field {name!r}: type {dtype.value} takes no parameters")
        return cls(field_id, name, dtype, nullable=nullable, default_value=default, **kwargs)

    def validate(self) -> None:
        if self.is_dynamic:
            if (self.name, self.dtype, self.nullable) != (DYNAMIC_FIELD, DataType.JSON, True):
                raise ValueError(f"the dynamic field is a nullable json named {DYNAMIC_FIELD!r}")
        elif not self.name.isidentifier():
            raise ValueError(f"field name {self.name!r} must be an identifier")
        if self.dtype in VECTOR_TYPES and (self.dim is None or self.dim <= 0):
            raise ValueError(f"vector field {self.name!r} needs a positive dim")
        if self.is_sparse and self.dim is not None:
            raise ValueError(f"sparse vector field {self.name!r} has no dim")
        if self.is_binary_vector and self.dim is not None and self.dim % 8:
            raise ValueError(
                f"binary vector field {self.name!r}: dim counts bits, a multiple of 8, got {self.dim}"
            )
        if self.is_primary and self.dtype not in (DataType.INT64, DataType.VARCHAR):
            raise ValueError(f"primary key {self.name!r} must be int64 or varchar(N), not {self.type_name}")
        if (self.is_primary or self.is_vector) and (self.nullable or self.default_value is not None):
            kind = "primary key" if self.is_primary else "vector field"
            raise ValueError(f"{kind} {self.name!r} cannot be nullable or have a default value")
        self._validate_params()
        if self.default_value is not None:
            self._validate_default()
        if self.is_partition_key and (
            self.is_primary
            or self.dtype not in (DataType.INT64, DataType.VARCHAR)
            or self.nullable
            or self.default_value is not None
        ):
            raise ValueError(
                f"partition key {self.name!r} must be an int64 or varchar field other than the primary key, "
                "neither nullable nor with a default value"
            )

    def _validate_params(self) -> None:
        wants_length = self.dtype is DataType.VARCHAR or self.element_type is DataType.VARCHAR
        if wants_length and not (self.max_length and 1 <= self.max_length <= MAX_VARCHAR_LENGTH):
            raise ValueError(
                f"field {self.name!r}: max_length must be in [1, {MAX_VARCHAR_LENGTH}], got {self.max_length}"
            )
        if not wants_length and self.max_length is not None:
            raise ValueError(f"field {self.name!r}: only a varchar (or an array of varchar) has a max_length")
        if self.dtype is DataType.ARRAY:
            if self.element_type not in ELEMENT_TYPES:
                allowed = ", ".join(sorted(t.value for t in ELEMENT_TYPES))
                raise ValueError(
                    f"field {self.name!r}: an array holds one of {allowed}, not {self.element_type}"
                )
            if not (self.max_capacity and 1 <= self.max_capacity <= MAX_ARRAY_CAPACITY):
                raise ValueError(
                    f"field {self.name!r}: max_capacity must be in [1, {MAX_ARRAY_CAPACITY}], got {self.max_capacity}"
                )
        elif self.element_type is not None or self.max_capacity is not None:
            raise ValueError(f"field {self.name!r}: only an array has an element type and a max_capacity")

    def _validate_default(self) -> None:
        assert self.default_value is not None
        try:
            value = json.loads(self.default_value)
        except json.JSONDecodeError:
            raise ValueError(
                f"field {self.name!r}: default value {self.default_value!r} is not JSON"
            ) from None
        if not _default_fits(self, value):
            raise ValueError(f"field {self.name!r}: default value {value!r} is not a {self.type_name}")


def _split_type(spec: str, name: str) -> tuple[DataType, list[str], str]:
    """`array(varchar(8), 4)?=x` -> (ARRAY, ["varchar(8)", "4"], "?=x"): the type, its
    parameters split at top-level commas, and what follows."""
    text = spec.strip()
    found = re.match(r"[A-Za-z0-9_]+", text)
    if not found:
        raise ValueError(f"field {name!r}: cannot read type {spec!r}")
    try:
        dtype = DataType(found.group().lower())
    except ValueError:
        allowed = ", ".join(t.value for t in DataType)
        raise ValueError(f"field {name!r}: unknown type {found.group()!r} (types: {allowed})") from None
    rest = text[found.end() :].lstrip()
    if not rest.startswith("("):
        return dtype, [], rest
    depth, params, start = 0, [], 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 1:
            params.append(rest[start:i].strip())
            start = i + 1
        if depth == 0:
            params.append(rest[start:i].strip())
            return dtype, params, rest[i + 1 :].strip()
    raise ValueError(f"field {name!r}: unbalanced parentheses in {spec!r}")


def _one_int(params: list[str], name: str, form: str) -> int:
    if len(params) != 1 or not params[0].isdigit():
        raise ValueError(f"field {name!r}: expected {form}")
    return int(params[0])


def _default_json(raw: str, dtype: DataType) -> str:
    """A default as JSON text; a VarChar's default may be written without quotes."""
    try:
        json.loads(raw)
    except json.JSONDecodeError:
        if dtype not in TEXT_TYPES:
            raise ValueError(f"default value {raw!r} is not JSON") from None
        return json.dumps(raw)
    return raw


def _default_fits(field: FieldSchema, value: Any) -> bool:
    """Milvus' rule: a default for a scalar of a fixed type (not JSON, not an array), of that type."""
    kind = field.dtype
    if kind in INTEGER_TYPES:
        low, high = INTEGER_RANGES[kind]
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if kind in (DataType.FLOAT, DataType.DOUBLE):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is DataType.BOOL:
        return isinstance(value, bool)
    if kind in TEXT_TYPES:
        limit = field.text_limit or MAX_VARCHAR_LENGTH
        return isinstance(value, str) and len(value.encode()) <= limit
    return False


# Field IDs below 100 are system fields, as in Milvus.
ROW_ID_FIELD = 0
TIMESTAMP_FIELD = 1
FIRST_USER_FIELD_ID = 100


@dataclass(frozen=True)
class CollectionSchema(Record):
    fields: tuple[FieldSchema, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError("field names must be unique")
        if len({f.field_id for f in self.fields}) != len(self.fields):
            raise ValueError("field ids must be unique")
        primaries = [f for f in self.fields if f.is_primary]
        if len(primaries) != 1:
            raise ValueError("a schema needs exactly one primary key field (int64 or varchar)")
        for f in self.fields:
            f.validate()
        if sum(f.is_dynamic for f in self.fields) > 1:
            raise ValueError("a schema has one dynamic field at most")
        if sum(f.is_partition_key for f in self.fields) > 1:
            raise ValueError("a schema has one partition key at most")

    @classmethod
    def build(
        cls,
        primary: str,
        vectors: Mapping[str, int | str],
        scalars: Mapping[str, str],
        pk_type: str = "int64",
        dynamic: bool = False,
        partition_key: str | None = None,
    ) -> CollectionSchema:
        """Schema from names: `vectors` name -> dim of a float vector, or a spec
        ("float16_vector(128)", "bfloat16_vector(768)", "binary_vector(256)", "sparse_float_vector"),
        `scalars` name -> type spec
        (`FieldSchema.from_spec`: "int32", "varchar(64)?", "array(int64, 8)", "float=0.5");
        the primary key is `pk_type`: "int64" or "varchar(N)"; with `dynamic`, the dynamic
        field `$meta` keeps the keys of inserted rows the schema does not have;
        `partition_key` names the scalar whose value picks each row's partition."""
        fid = FIRST_USER_FIELD_ID
        fields = [replace(FieldSchema.from_spec(fid, primary, pk_type), is_primary=True)]
        for name, dim in vectors.items():
            fid += 1
            if isinstance(dim, str):  # "float16_vector(128)"
                fields.append(FieldSchema.from_spec(fid, name, dim))
            else:
                fields.append(FieldSchema(fid, name, DataType.FLOAT_VECTOR, dim=dim))
        for name, dtype in scalars.items():
            fid += 1
            fields.append(FieldSchema.from_spec(fid, name, dtype))
        if partition_key is not None:
            if partition_key not in scalars:
                raise ValueError(
                    f"partition key {partition_key!r} is not one of the scalar fields {sorted(scalars)}"
                )
            fields = [replace(f, is_partition_key=True) if f.name == partition_key else f for f in fields]
        if dynamic:
            fields.append(FieldSchema(fid + 1, DYNAMIC_FIELD, DataType.JSON, nullable=True, is_dynamic=True))
        return cls(tuple(fields))

    @property
    def dynamic_field(self) -> FieldSchema | None:
        return next((f for f in self.fields if f.is_dynamic), None)

    @property
    def partition_key(self) -> FieldSchema | None:
        return next((f for f in self.fields if f.is_partition_key), None)

    @property
    def primary(self) -> FieldSchema:
        return next(f for f in self.fields if f.is_primary)

    @property
    def vector_fields(self) -> tuple[FieldSchema, ...]:
        return tuple(f for f in self.fields if f.is_vector)

    @property
    def scalar_fields(self) -> tuple[FieldSchema, ...]:
        return tuple(f for f in self.fields if not f.is_vector)

    def field(self, name: str) -> FieldSchema:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def row_bytes(self) -> int:
        """Estimated bytes per row, for segment capacity (strings and JSON count up to 64
        bytes, arrays a quarter of their capacity, a sparse vector `SPARSE_ROW_BYTES`)."""
        return 16 + sum(_estimated_bytes(f) for f in self.fields)  # 16: row id + timestamp


_FIXED_BYTES = {
    DataType.INT8: 1,
    DataType.INT16: 2,
    DataType.INT32: 4,
    DataType.INT64: 8,
    DataType.FLOAT: 4,
    DataType.DOUBLE: 8,
    DataType.BOOL: 1,
}
# A sparse row's estimate: 100 (index, value) pairs of 12 bytes (a SPLADE row has ~100-200).
SPARSE_ROW_BYTES = 1_200


def _estimated_bytes(field: FieldSchema) -> int:
    if field.is_sparse:
        return SPARSE_ROW_BYTES
    if field.is_vector:
        return field.vector_bytes if field.dim else 0
    if field.dtype is DataType.ARRAY:
        assert field.element_type is not None and field.max_capacity is not None
        element = _FIXED_BYTES.get(field.element_type) or min(field.max_length or 64, 64)
        return max(1, field.max_capacity // 4) * element
    if field.dtype in TEXT_TYPES:
        return min(field.text_limit or 64, 64)
    return _FIXED_BYTES.get(field.dtype, 64)  # JSON: 64


@dataclass(frozen=True)
class CollectionInfo(Record):
    id: int
    name: str
    schema: CollectionSchema
    partitions: tuple[int, ...]
    vchannels: tuple[str, ...]
    start_positions: tuple[MsgPosition, ...] = ()
    created_at: float = 0.0
    partition_names: tuple[str, ...] = ()
    dropped_at: float = 0.0  # 0: live; else when it was dropped (its log stays readable)
    # Milvus' `collection.ttl.seconds`: a row older than this (by its insert timestamp) is
    # expired: no read or search returns it, and compaction drops it. 0: rows never expire.
    ttl_seconds: int = 0

    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset({"ttl_seconds"})

    def expired_before(self, ts: int) -> int:
        """The timestamp below which rows are expired for a read at `ts` (0: none are)."""
        if not self.ttl_seconds:
            return 0
        return max(0, compose_ts(physical_ms(ts) - self.ttl_seconds * 1000))

    def partition_id(self, name: str) -> int:
        try:
            return self.partitions[self.partition_names.index(name)]
        except ValueError:
            raise KeyError(f"collection {self.name!r} has no partition {name!r}") from None

    def validate(self) -> None:
        if not self.vchannels:
            raise ValueError("field 'vchannels' must be a non-empty list of strings")
        if self.partition_names and len(self.partition_names) != len(self.partitions):
            raise ValueError("'partition_names' and 'partitions' differ in length")
        if self.ttl_seconds < 0:
            raise ValueError(f"field 'ttl_seconds' must be >= 0, got {self.ttl_seconds}")


# --- segments and binlogs ---------------------------------------------------------------

# The binlog layout (docs/architecture.md, "Binlogs"): keys relative to the storage root.
# Declared here, below `storage.layout` which re-exports it, because a segment's record
# derives the paths of its binlogs from it (`SegmentInfo.to_dict`).
INSERT_LOG = "insert_log"
DELTA_LOG = "delta_log"
STATS_LOG = "stats_log"


def insert_log_key(collection_id: int, partition_id: int, segment_id: int, group: int, log_id: int) -> str:
    return f"{INSERT_LOG}/{collection_id}/{partition_id}/{segment_id}/{group}/{log_id}.parquet"


def delta_log_key(collection_id: int, partition_id: int, segment_id: int, log_id: int) -> str:
    return f"{DELTA_LOG}/{collection_id}/{partition_id}/{segment_id}/{log_id}.parquet"


def stats_log_key(collection_id: int, partition_id: int, segment_id: int, log_id: int) -> str:
    return f"{STATS_LOG}/{collection_id}/{partition_id}/{segment_id}/{log_id}"


class SegmentState(enum.StrEnum):
    GROWING = "Growing"
    SEALED = "Sealed"
    FLUSHING = "Flushing"
    FLUSHED = "Flushed"
    DROPPED = "Dropped"
    IMPORTING = "Importing"  # written by a bulk import, invisible until its job commits


class SegmentLevel(enum.StrEnum):
    L0 = "L0"  # deletes only
    L1 = "L1"
    L2 = "L2"


@dataclass(frozen=True)
class Binlog(Record):
    log_id: int
    path: str  # key relative to the storage root
    entries: int
    ts_from: int
    ts_to: int
    size_bytes: int


@dataclass(frozen=True)
class ColumnGroupBinlogs(Record):
    """Binlogs of one column group (storage v2): fields stored together in one file."""

    group: int
    field_ids: tuple[int, ...]
    logs: tuple[Binlog, ...]


@dataclass(frozen=True)
class SegmentInfo(Record):
    id: int
    collection_id: int
    partition_id: int
    vchannel: str
    state: SegmentState
    level: SegmentLevel = SegmentLevel.L1
    num_rows: int = 0
    max_rows: int = 0
    binlogs: tuple[ColumnGroupBinlogs, ...] = ()
    deltalogs: tuple[Binlog, ...] = ()
    statslogs: tuple[Binlog, ...] = ()
    start_position: MsgPosition | None = None
    dml_position: MsgPosition | None = None
    compaction_from: tuple[int, ...] = ()
    is_sorted: bool = False
    last_flush_ts: int = 0
    created_at: float = 0.0
    last_insert_at: float = 0.0
    seal_ts: int = 0  # TSO timestamp of the seal (policy or flush); 0: not sealed
    dropped_at: float | None = None  # when it became Dropped (garbage collection waits a tolerance)
    import_job: int | None = None  # the bulk import job that wrote it (None: written from the log)
    # Flushed but not yet served as flushed: readers see it as growing, and a compaction
    # output that is invisible is not served at all (its inputs are), see query/view.py.
    is_invisible: bool = False
    flushed_at: float | None = None  # when the flush made it Flushed (None: before it was recorded)
    # A compaction's drop: the timestamp oracles' ceiling at its commit (0: not recorded), at
    # or above every timestamp issued before it, which can run seconds ahead of the wall
    # clock of `dropped_at`. A read at an earlier T serves the segment again (query/asof.py).
    dropped_ts: int = 0
    # A mix compaction output that waits for its index (`awaited_indexes`): the timestamp
    # from which it replaces its inputs in the query view, stamped by the commit of its
    # last awaited build (or when the wait is given up: a build Failed for good, or
    # VCHAN_INDEX_HANDOFF_TIMEOUT). 0: not stamped (still waiting, or it never waited).
    ready_ts: int = 0

    # Left out when None: as written before they existed.
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"dropped_at", "import_job", "flushed_at"})
    # Left out when False (0): as written before they existed.
    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset({"is_invisible", "dropped_ts", "ready_ts"})

    def to_dict(self) -> dict[str, Any]:
        """The record, each binlog without the `path` the layout derives from its segment,
        column group and log ID (most of a segment's bytes otherwise); a path the layout
        does not derive (an older layout, a file written elsewhere) is kept as is."""
        out = super().to_dict()
        ids = (self.collection_id, self.partition_id, self.id)
        for group, stored in zip(self.binlogs, out["binlogs"], strict=True):
            _omit_derived(group.logs, stored["logs"], partial(insert_log_key, *ids, group.group))
        _omit_derived(self.deltalogs, out["deltalogs"], partial(delta_log_key, *ids))
        _omit_derived(self.statslogs, out["statslogs"], partial(stats_log_key, *ids))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        """The record `to_dict` wrote, the paths it left out derived again; a value written
        with every path (before they were derived) decodes unchanged."""
        return super().from_dict(_with_paths(d))

    def with_changes(self, **changes: Any) -> SegmentInfo:
        return replace(self, **changes)

    @property
    def binlog_files(self) -> list[Binlog]:
        return [b for g in self.binlogs for b in g.logs]

    @cached_property
    def binlog_bytes(self) -> int:
        """The bytes of its insert binlogs (computed once per decoded record: the
        DataCoord's summary adds them up over every segment at each reload)."""
        return sum(b.size_bytes for g in self.binlogs for b in g.logs)

    @cached_property
    def file_paths(self) -> tuple[str, ...]:
        """Every file its meta names: insert, delta and stats logs (computed once per decoded
        record: garbage collection gathers them over every segment at each pass)."""
        return (
            *(b.path for g in self.binlogs for b in g.logs),
            *(b.path for b in self.deltalogs),
            *(b.path for b in self.statslogs),
        )

    @cached_property
    def summary_row(self) -> tuple[tuple[str, SegmentState, SegmentLevel], tuple[int, ...]]:
        """Its group in the DataCoord's segment summary, (vchannel, state, level), and what
        it adds to the group's counts: segments, rows, insert binlog bytes, sorted,
        invisible, compacted (computed once per decoded record: the summary adds them up
        over every segment at each reload, most of them unchanged since the last)."""
        invisible = self.is_invisible and self.state is not SegmentState.DROPPED
        counts = (
            1,
            self.num_rows,
            self.binlog_bytes,
            int(self.is_sorted),
            int(invisible),
            int(bool(self.compaction_from)),
        )
        return (self.vchannel, self.state, self.level), counts

    @cached_property
    def flush_to_sorted(self) -> float | None:
        """Seconds from the flush that left it invisible to the commit of the sort that
        replaced it (None unless its sort replaced it)."""
        replaced = self.state is SegmentState.DROPPED and self.is_invisible
        if not replaced or self.flushed_at is None or self.dropped_at is None:
            return None
        return max(0.0, self.dropped_at - self.flushed_at)


@dataclass(frozen=True)
class SegmentGroup(Record):
    """The segments of one vchannel in one state and level, counted (a segment summary's row)."""

    vchannel: str
    state: SegmentState
    level: SegmentLevel
    segments: int
    rows: int  # L0: deletes
    binlog_bytes: int  # insert binlogs
    sorted: int  # sorted by primary key
    invisible: int  # flushed, served as growing until its sort replaces it (never a Dropped one)
    compacted: int  # written by a compaction (its `compaction_from` names what it replaced)


@dataclass(frozen=True)
class InvisibleSegment(Record):
    """A flushed segment still waiting for its sort, and since when."""

    segment_id: int
    vchannel: str
    flushed_at: float


@dataclass(frozen=True)
class LatencyBucket(Record):
    """How many sorts took a flush -> sorted time in bucket `bucket` of a log scale
    (datacoord/segment_summary.py, LATENCY_RATIO)."""

    bucket: int
    count: int


@dataclass(frozen=True)
class SegmentSummary(Record):
    """`meta/summary/{collection}`: a collection's segment meta counted, what the default
    `vchan status` shows without reading a segment key. Written by the active DataCoord at
    its meta reload from the listing it holds (datacoord/segment_summary.py)."""

    collection_id: int
    groups: tuple[SegmentGroup, ...]  # by (vchannel, state, level), in that order
    # The oldest invisible segments (those with a `flushed_at`), oldest first, at most
    # OLDEST_KEPT: the hand-off's oldest wait and the late ones status names.
    oldest_invisible: tuple[InvisibleSegment, ...]
    # The flush -> sorted times of the sorted parents still in meta, as a histogram.
    sort_latency: tuple[LatencyBucket, ...]
    revision: int  # the etcd revision of the segment listing it was computed from
    computed_at: float  # seconds since the epoch

    def same_counts(self, other: SegmentSummary) -> bool:
        """Whether both say the same of the segments (whenever and from whichever listing)."""
        return (self.collection_id, self.groups, self.oldest_invisible, self.sort_latency) == (
            other.collection_id,
            other.groups,
            other.oldest_invisible,
            other.sort_latency,
        )


def _omit_derived(logs: Sequence[Binlog], stored: list[dict[str, Any]], derive: Callable[[int], str]) -> None:
    for binlog, out in zip(logs, stored, strict=True):
        if binlog.path == derive(binlog.log_id):
            del out["path"]


def _with_paths(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """`d` with the binlog paths it left out derived (`d` as it is when its ids are not
    ints: the generic decoding then names what is wrong)."""
    collection, partition, segment = (d.get(name) for name in ("collection_id", "partition_id", "id"))
    if not (type(collection) is int and type(partition) is int and type(segment) is int):
        return d
    ids = (collection, partition, segment)
    out = dict(d)
    binlogs = d.get("binlogs")
    if isinstance(binlogs, list):
        out["binlogs"] = [
            {**g, "logs": _paths(g.get("logs"), partial(insert_log_key, *ids, g["group"]))}
            if isinstance(g, dict) and type(g.get("group")) is int
            else g
            for g in binlogs
        ]
    out["deltalogs"] = _paths(d.get("deltalogs"), partial(delta_log_key, *ids))
    out["statslogs"] = _paths(d.get("statslogs"), partial(stats_log_key, *ids))
    return out


def _paths(logs: Any, derive: Callable[[int], str]) -> Any:
    """Binlog dicts, each with its path (derived from its log ID where it has none)."""
    if not isinstance(logs, list):
        return logs
    return [
        {**b, "path": derive(b["log_id"])}
        if isinstance(b, dict) and "path" not in b and type(b.get("log_id")) is int
        else b
        for b in logs
    ]


@dataclass(frozen=True)
class OpenSegment(Record):
    """A growing segment open for inserts on one channel, as its channel head holds it."""

    segment_id: int
    collection_id: int
    partition_id: int
    max_rows: int
    allocated: int = 0  # rows handed out (some may never have been appended: a failed batch)
    created_at: float = 0.0
    last_insert_at: float = 0.0
    last_ts: int = 0  # largest timestamp of a row handed out
    vchannel: str = ""
    binlog_files: int = 0  # most binlog files of one column group, as last read from etcd

    @property
    def free(self) -> int:
        return max(self.max_rows - self.allocated, 0)


@dataclass(frozen=True)
class ChannelHead(Record):
    """`wal-head/{vchannel}`: the tail of a channel's log and its open segments, changed
    only by the holder of the channel's append lock (`meta.channel_head`)."""

    vchannel: str
    next_offset: int = 0  # offset of the next message (the first of the next file)
    last_ts: int = 0  # no later message or seal on the channel gets a timestamp <= this
    open_segments: tuple[OpenSegment, ...] = ()


# --- indexes (docs/indexes.md: meta/field-index/..., meta/segment-index/...) -------------


class IndexType(enum.StrEnum):
    FLAT = "FLAT"  # exact: nothing is built
    IVF_FLAT = "IVF_FLAT"
    IVF_PQ = "IVF_PQ"
    HNSW = "HNSW"
    # Sparse float vectors (metric IP): an inverted index, posting lists per index. Milvus'
    # WAND variant prunes the same lists while searching; its results are the same here.
    SPARSE_INVERTED_INDEX = "SPARSE_INVERTED_INDEX"
    SPARSE_WAND = "SPARSE_WAND"
    BIN_FLAT = "BIN_FLAT"  # binary vectors, exact: nothing is built
    BIN_IVF_FLAT = "BIN_IVF_FLAT"  # binary vectors: faiss's IndexBinaryIVF

    @property
    def is_sparse(self) -> bool:
        return self in (IndexType.SPARSE_INVERTED_INDEX, IndexType.SPARSE_WAND)


# The index types of binary vectors.
BINARY_INDEX_TYPES = frozenset({IndexType.BIN_FLAT, IndexType.BIN_IVF_FLAT})
# The index types searched exactly, with no files.
EXACT_INDEX_TYPES = frozenset({IndexType.FLAT, IndexType.BIN_FLAT})


# Segments with fewer rows get no index files (Milvus' minimum): searched exactly.
MIN_ROWS_TO_BUILD = 1024


def needs_build(kind: IndexType, rows: int) -> bool:
    """Whether a segment of `rows` rows gets index files (FLAT and small segments do not)."""
    return kind not in EXACT_INDEX_TYPES and rows >= MIN_ROWS_TO_BUILD


class MetricType(enum.StrEnum):
    L2 = "L2"  # squared Euclidean distance: smaller is nearer
    IP = "IP"  # inner product: larger is nearer
    COSINE = "COSINE"  # inner product of normalized vectors: larger is nearer
    HAMMING = "HAMMING"  # binary vectors: the bits that differ, smaller is nearer
    JACCARD = "JACCARD"  # binary vectors: 1 - |a and b| / |a or b|, smaller is nearer

    @property
    def larger_is_nearer(self) -> bool:
        return self in (MetricType.IP, MetricType.COSINE)


# The metrics of binary vectors; the others are of float vectors.
BINARY_METRICS = frozenset({MetricType.HAMMING, MetricType.JACCARD})


@dataclass(frozen=True)
class IndexParam(Record):
    """One build parameter of an index (`nlist`, `m`, `nbits`, `M`, `efConstruction`; a
    float: `drop_ratio_build`)."""

    name: str
    value: int | float


@dataclass(frozen=True)
class FieldIndex(Record):
    """An index on one vector field: `meta/field-index/{collection}/{index}`. Dropping it
    only marks it `deleted` (no new builds start); garbage collection removes the rest."""

    index_id: int
    collection_id: int
    name: str
    field_id: int
    field: str
    type: IndexType
    metric: MetricType
    params: tuple[IndexParam, ...] = ()  # as given (sorted by name): defaults are chosen per segment
    created_at: float = 0.0
    deleted: bool = False
    deleted_at: float | None = None

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"deleted_at"})

    def param(self, name: str) -> int | float | None:
        return next((p.value for p in self.params if p.name == name), None)

    def same_definition(self, other: FieldIndex) -> bool:
        """Same name, field, type, metric and params (what makes a create idempotent)."""
        mine = (self.name, self.field_id, self.type, self.metric, self.params)
        return mine == (other.name, other.field_id, other.type, other.metric, other.params)


def awaited_indexes(seg: SegmentInfo, indexes: Sequence[FieldIndex]) -> list[FieldIndex]:
    """The indexes a compaction output waits for before it replaces its inputs in the query
    view (a search would otherwise lose the inputs' indexes): the live indexes of its
    collection, created before it (a fixed set: a read in the past decides as it did then),
    that get files for its rows. A sort output's input is invisible: it never waits (the
    view replaces an invisible input at once)."""
    if not seg.compaction_from or seg.level is SegmentLevel.L0:
        return []
    return [
        i
        for i in indexes
        if not i.deleted
        and i.collection_id == seg.collection_id
        and i.created_at <= seg.created_at
        and needs_build(i.type, seg.num_rows)
    ]


def replaces_inputs_at(seg: SegmentInfo, indexes: Sequence[FieldIndex], ts: int | None = None) -> bool:
    """Whether a compaction output replaces its (visible) inputs in a read at `ts` (None:
    now): it awaits no index, or it was stamped ready at or before `ts`."""
    if seg.ready_ts:
        return ts is None or seg.ready_ts <= ts
    return not awaited_indexes(seg, indexes)


class SegmentIndexState(enum.StrEnum):
    UNISSUED = "Unissued"  # waiting for a builder
    IN_PROGRESS = "InProgress"
    FINISHED = "Finished"
    FAILED = "Failed"


@dataclass(frozen=True)
class SegmentIndex(Record):
    """The build of one index on one segment: `meta/segment-index/{collection}/{partition}/
    {segment}/{build}`. Each start takes the next `version`; its files live under
    `index_files/{build}/{version}/`. Finished with no files: nothing to build (FLAT, or a
    segment too small to index), searched exactly."""

    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset({"reissue_reason"})

    build_id: int
    index_id: int
    collection_id: int
    partition_id: int
    segment_id: int
    rows: int
    state: SegmentIndexState = SegmentIndexState.UNISSUED
    version: int = 0  # builds started (1 for the first)
    fail_reason: str = ""
    node: str = ""  # who built (or is building) it: host:pid, or the Spark job
    files: tuple[str, ...] = ()  # storage keys
    serialized_size: int = 0
    engine_version: str = ""  # the library that built it, e.g. "faiss-1.15.1"
    # The index engine version its file was built for (`indexes.engine`); 0: built before
    # versions were recorded (read as version 1, the only one there was).
    engine: int = 0
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    # Why it was last sent back to Unissued (or re-finished without files): its file found
    # unusable, an engine upgrade, rows of its segment quarantined.
    reissue_reason: str = ""


class TaskState(enum.StrEnum):
    QUEUED = "Queued"
    IN_PROGRESS = "InProgress"
    FAILED = "Failed"  # out of attempts: waits for an operator (`vchan index --retry`)


@dataclass(frozen=True)
class TaskRecord(Record):
    """One task of the DataCoord's scheduler (`datacoord.tasks`): `meta/task/{kind}/
    {collection}/{segment}`, one per (kind, segment). Deleted once done; what the task does
    (and its own outcome, e.g. a SegmentIndex) is the kind's."""

    kind: str  # "sort", "index"
    collection_id: int
    partition_id: int
    segment_id: int
    rows: int = 0
    memory_mb: float = 0.0  # the estimate admission counts against VCHAN_TASK_MEMORY_MB
    state: TaskState = TaskState.QUEUED
    attempts: int = 0  # attempts spent (a worker's death counts only from its second in a row)
    reason: str = ""  # why the last attempt failed
    worker: str = ""  # host:pid@term of the DataCoord running it
    created_at: float = 0.0
    started_at: float = 0.0
    # A failed attempt's backoff: the task is not run again before this wall-clock time.
    not_before: float = 0.0
    # Its worker died while running it this many times in a row: from the first, it runs
    # alone; from the second, each death spends an attempt (the task is the likely cause).
    deaths: int = 0
    # Times it ended Failed: a Failed task is tried again on its own at `not_before`
    # (VCHAN_TASK_FAILED_RETRY, doubled each further time), or by `vchan tasks --retry`.
    failures: int = 0

    # Left out when 0: as written before they existed.
    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset({"not_before", "deaths", "failures"})


@dataclass(frozen=True)
class DataLoss(Record):
    """A damaged file an operator quarantined (`vchan quarantine`), so its channel or
    segment could go on without it: `meta/data-loss/{collection}/{loss}`, never deleted, so
    the loss stays visible (`vchan status`, the catalog's `data_losses`).

    A log file (`kind` "log"): the offsets `first_offset`..`last_offset` of `vchannel` are
    lost; a placeholder of time ticks holds their place in the log. A binlog of a flushed
    segment (`kind` "binlog"): its `rows` of `segment_id` are lost (the same rows' files of
    the other column groups and their stats log leave the segment too); its other binlog
    files are kept."""

    loss_id: int
    collection_id: int
    kind: str  # "log" or "binlog"
    path: str  # the damaged file, where it was
    moved_to: str  # where it is kept now (for forensics)
    reason: str  # why it could not be read
    vchannel: str = ""
    first_offset: int = -1
    last_offset: int = -1
    at: float = 0.0
    segment_id: int = 0
    rows: int = 0

    @property
    def messages(self) -> int:
        return self.last_offset - self.first_offset + 1 if self.kind == "log" else 0


# --- sessions, leases and watch infos ----------------------------------------------------


class SessionState(enum.StrEnum):
    """A node's state in its session (Milvus' stateCode). Only a HEALTHY node gets channels."""

    INITIALIZING = "INITIALIZING"  # registered, not yet able to work (watch, Spark session)
    HEALTHY = "HEALTHY"
    ABNORMAL = "ABNORMAL"  # alive but unable to work (its Spark session failed or died): `reason`
    STOPPING = "STOPPING"  # leaving (SIGTERM): its channels move at once


def version_key(version: str) -> tuple[int, ...]:
    """A package version's numbers, to compare (`"0.1.0"` -> (0, 1, 0)); () if it has none."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


@dataclass(frozen=True)
class IndexEngine(Record):
    """The index engine versions a process reads (Milvus' IndexEngineVersion): index
    files of versions `minimal` to `current`; builds use the lowest `current` stated."""

    current: int
    minimal: int

    def reads(self, version: int) -> bool:
        return self.minimal <= version <= self.current


# The session address of a DataNode hosted by a Dagster sensor: `dagster:{slot}`.
DAGSTER_ADDRESS = "dagster:"


@dataclass(frozen=True)
class NodeSession(Record):
    """A node's session value (`session/datanode/{id}`, or the DataCoord's election key).

    `version` is the node's package version (rolling upgrades compare it); `since` is when
    the node entered `state` (seconds since the epoch; 0 in sessions of older nodes, which
    write no such field); `reason` says why it is ABNORMAL."""

    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset({"since", "reason"})
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"index_engine"})

    node_id: int
    address: str
    version: str
    started_at: float
    state: SessionState = SessionState.HEALTHY
    since: float = 0.0
    index_engine: IndexEngine | None = None  # stated by the processes that load indexes
    reason: str = ""

    def entered(self, state: SessionState, now: float | None = None, reason: str = "") -> NodeSession:
        """This session in `state` (for `reason`), entered now."""
        return replace(self, state=state, since=time.time() if now is None else now, reason=reason)

    def older_than(self, version: str) -> bool:
        """Whether this node runs a package older than `version` (either unparsable: no)."""
        want, have = version_key(version), version_key(self.version)
        return bool(want and have) and have < want


@dataclass(frozen=True)
class ChannelLease(Record):
    """Who may write a channel's meta: `channel-lease/{vchannel}`."""

    lease_id: int
    node_id: int
    granted_at: float


@dataclass(frozen=True)
class ReadPin(Record):
    """A running read: `meta/read-pin/{pin}`, on an etcd lease of VCHAN_READ_PIN_TTL. While
    the key lives, GC keeps the files of every segment of the collection dropped at or after
    the read's timestamp: any of them the read may open."""

    collection_id: int
    as_of: int  # the read's timestamp (hybrid)
    host: str
    pid: int
    started_at: float


@dataclass(frozen=True)
class StreamOffset(Record):
    """A change stream's position in one vchannel: the last offset it has read."""

    vchannel: str
    offset: int  # -1: nothing read yet


@dataclass(frozen=True)
class StreamRecord(Record):
    """A registered change stream (`spark.readStream.format("vchan")`): `meta/stream/{stream}`.
    Log retention keeps every log file holding an offset after `offsets` until the stream
    has not been seen for VCHAN_STREAM_IDLE_TIMEOUT."""

    collection_id: int
    collection: str
    offsets: tuple[StreamOffset, ...]  # what the stream's sink has committed
    last_seen: float  # seconds since the epoch: the stream's last planning or commit
    host: str
    pid: int

    def offset_of(self, vchannel: str) -> int | None:
        return next((o.offset for o in self.offsets if o.vchannel == vchannel), None)


@dataclass(frozen=True)
class SyncClaim(Record):
    """The sync running now on a channel: `channel-sync/{vchannel}`. Every meta write of a
    sync compares this key's version with the one its own claim left, so of two syncs of
    one channel under the same lease only the one that claimed last commits."""

    lease_id: int
    host: str
    pid: int
    started_at: float


class WatchState(enum.StrEnum):
    TO_WATCH = "ToWatch"
    WATCH_SUCCESS = "WatchSuccess"
    WATCH_FAILURE = "WatchFailure"
    TO_RELEASE = "ToRelease"
    RELEASE_SUCCESS = "ReleaseSuccess"
    RELEASE_FAILURE = "ReleaseFailure"


@dataclass(frozen=True)
class VchannelInfo(Record):
    collection_id: int
    channel_name: str
    seek_position: MsgPosition | None = None
    unflushed_segment_ids: tuple[int, ...] = ()
    flushed_segment_ids: tuple[int, ...] = ()
    dropped_segment_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChannelWatchInfo(Record):
    vchan: VchannelInfo
    state: WatchState
    start_ts: float
    timeout_ts: float
    progress: int = 0
    op_id: int = 0
    lease_id: int | None = None  # None: written by an older coordinator
    reason: str = ""


@dataclass(frozen=True)
class RecoveryInfo:
    """What a DataNode needs to (re)start a vchannel: recovery is the same as starting."""

    vchannel: str
    collection_id: int
    seek_position: MsgPosition | None
    unflushed_segment_ids: tuple[int, ...] = ()
    flushed_segment_ids: tuple[int, ...] = ()
    dropped_segment_ids: tuple[int, ...] = ()
    segments: Sequence[SegmentInfo] = field(default_factory=tuple)
