"""The domain model: small immutable records, each with one dict form.

`to_dict` / `from_dict` are the only serialization; `meta.codec` adds the schema
version and turns a validation failure into an error that names the etcd key.
`from_dict` validates types and raises `ValueError` with the field name.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

T = TypeVar("T")


# --- validation helpers ------------------------------------------------------------------


def _get(d: Mapping[str, Any], name: str, kind: type[T] | tuple[type, ...], default: Any = ...) -> Any:
    if name not in d or d[name] is None:
        if default is ...:
            raise ValueError(f"missing field {name!r}")
        return default
    value = d[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and kind is not bool:
        raise ValueError(f"field {name!r} must be {_kind_name(kind)}, got bool")
    if not isinstance(value, kind):
        raise ValueError(f"field {name!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return str(kind.__name__)


def _ints(d: Mapping[str, Any], name: str) -> tuple[int, ...]:
    values = _get(d, name, list, [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"field {name!r} must be a list of integers")
    return tuple(values)


def _enum(d: Mapping[str, Any], name: str, kind: type[enum.Enum], default: Any = ...) -> Any:
    raw = _get(d, name, str, default)
    if isinstance(raw, kind):
        return raw
    try:
        return kind(raw)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ValueError(f"field {name!r} is {raw!r}, expected one of: {allowed}") from None


def _nested(d: Mapping[str, Any], name: str, cls: Any, default: Any = ...) -> Any:
    raw = _get(d, name, dict, default)
    if raw is None or not isinstance(raw, dict):
        return raw
    try:
        return cls.from_dict(raw)
    except ValueError as exc:
        raise ValueError(f"in {name!r}: {exc}") from None


def _nested_list(d: Mapping[str, Any], name: str, cls: Any) -> tuple[Any, ...]:
    out = []
    for i, item in enumerate(_get(d, name, list, [])):
        if not isinstance(item, dict):
            raise ValueError(f"{name}[{i}] must be an object")
        try:
            out.append(cls.from_dict(item))
        except ValueError as exc:
            raise ValueError(f"in {name}[{i}]: {exc}") from None
    return tuple(out)


# --- positions and timestamps ------------------------------------------------------------

LOGICAL_BITS = 18


def compose_ts(physical_ms: int, logical: int = 0) -> int:
    """Hybrid timestamp: physical milliseconds << 18 | logical counter (as Milvus' TSO)."""
    return (physical_ms << LOGICAL_BITS) | logical


def physical_ms(ts: int) -> int:
    return ts >> LOGICAL_BITS


@dataclass(frozen=True, order=True)
class MsgPosition:
    """A position in a vchannel: the message at `offset` and its timestamp."""

    channel: str
    offset: int
    timestamp: int

    def to_dict(self) -> dict[str, Any]:
        return {"channel": self.channel, "offset": self.offset, "timestamp": self.timestamp}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MsgPosition:
        offset = _get(d, "offset", int)
        if offset < -1:
            raise ValueError(f"field 'offset' must be >= -1, got {offset}")
        return cls(_get(d, "channel", str), offset, _get(d, "timestamp", int))


# --- schema and collections ------------------------------------------------------------


class DataType(enum.StrEnum):
    INT64 = "int64"
    FLOAT = "float"
    DOUBLE = "double"
    STRING = "string"
    BOOL = "bool"
    FLOAT_VECTOR = "float_vector"


@dataclass(frozen=True)
class FieldSchema:
    field_id: int
    name: str
    dtype: DataType
    is_primary: bool = False
    dim: int | None = None

    @property
    def is_vector(self) -> bool:
        return self.dtype is DataType.FLOAT_VECTOR

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "field_id": self.field_id,
            "name": self.name,
            "dtype": self.dtype.value,
            "is_primary": self.is_primary,
        }
        if self.dim is not None:
            d["dim"] = self.dim
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FieldSchema:
        f = cls(
            field_id=_get(d, "field_id", int),
            name=_get(d, "name", str),
            dtype=_enum(d, "dtype", DataType),
            is_primary=_get(d, "is_primary", bool, False),
            dim=_get(d, "dim", int, None),
        )
        f.validate()
        return f

    def validate(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"field name {self.name!r} must be an identifier")
        if self.is_vector and (self.dim is None or self.dim <= 0):
            raise ValueError(f"vector field {self.name!r} needs a positive dim")
        if self.is_primary and self.dtype is not DataType.INT64:
            raise ValueError(f"primary key {self.name!r} must be int64")


# Field IDs below 100 are system fields, as in Milvus.
ROW_ID_FIELD = 0
TIMESTAMP_FIELD = 1
FIRST_USER_FIELD_ID = 100


@dataclass(frozen=True)
class CollectionSchema:
    fields: tuple[FieldSchema, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError("field names must be unique")
        if len({f.field_id for f in self.fields}) != len(self.fields):
            raise ValueError("field ids must be unique")
        primaries = [f for f in self.fields if f.is_primary]
        if len(primaries) != 1:
            raise ValueError("a schema needs exactly one int64 primary key field")
        for f in self.fields:
            f.validate()

    @classmethod
    def build(cls, primary: str, vectors: Mapping[str, int], scalars: Mapping[str, str]) -> CollectionSchema:
        """Schema from names: `vectors` name -> dim, `scalars` name -> dtype value."""
        fid = FIRST_USER_FIELD_ID
        fields = [FieldSchema(fid, primary, DataType.INT64, is_primary=True)]
        for name, dim in vectors.items():
            fid += 1
            fields.append(FieldSchema(fid, name, DataType.FLOAT_VECTOR, dim=dim))
        for name, dtype in scalars.items():
            fid += 1
            fields.append(FieldSchema(fid, name, DataType(dtype)))
        return cls(tuple(fields))

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
        """Estimated bytes per row, for segment capacity (strings count 64 bytes)."""
        sizes = {
            DataType.INT64: 8,
            DataType.FLOAT: 4,
            DataType.DOUBLE: 8,
            DataType.BOOL: 1,
            DataType.STRING: 64,
        }
        total = 16  # row id + timestamp
        for f in self.fields:
            total += f.dim * 4 if f.is_vector and f.dim else sizes[f.dtype]
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"fields": [f.to_dict() for f in self.fields]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CollectionSchema:
        return cls(_nested_list(d, "fields", FieldSchema))


@dataclass(frozen=True)
class CollectionInfo:
    id: int
    name: str
    schema: CollectionSchema
    partitions: tuple[int, ...]
    vchannels: tuple[str, ...]
    start_positions: tuple[MsgPosition, ...] = ()
    created_at: float = 0.0
    partition_names: tuple[str, ...] = ()
    dropped_at: float = 0.0  # 0: live; else when it was dropped (its log stays readable)

    def partition_id(self, name: str) -> int:
        try:
            return self.partitions[self.partition_names.index(name)]
        except ValueError:
            raise KeyError(f"collection {self.name!r} has no partition {name!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "schema": self.schema.to_dict(),
            "partitions": list(self.partitions),
            "partition_names": list(self.partition_names),
            "vchannels": list(self.vchannels),
            "start_positions": [p.to_dict() for p in self.start_positions],
            "created_at": self.created_at,
            "dropped_at": self.dropped_at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CollectionInfo:
        vchannels = _get(d, "vchannels", list)
        if not vchannels or not all(isinstance(v, str) for v in vchannels):
            raise ValueError("field 'vchannels' must be a non-empty list of strings")
        partitions = _ints(d, "partitions")
        names = tuple(_get(d, "partition_names", list, []))
        if names and len(names) != len(partitions):
            raise ValueError("'partition_names' and 'partitions' differ in length")
        return cls(
            id=_get(d, "id", int),
            name=_get(d, "name", str),
            schema=_nested(d, "schema", CollectionSchema),
            partitions=partitions,
            vchannels=tuple(vchannels),
            start_positions=_nested_list(d, "start_positions", MsgPosition),
            created_at=_get(d, "created_at", float, 0.0),
            partition_names=names,
            dropped_at=_get(d, "dropped_at", float, 0.0),
        )


# --- segments and binlogs ---------------------------------------------------------------


class SegmentState(enum.StrEnum):
    GROWING = "Growing"
    SEALED = "Sealed"
    FLUSHING = "Flushing"
    FLUSHED = "Flushed"
    DROPPED = "Dropped"


class SegmentLevel(enum.StrEnum):
    L0 = "L0"  # deletes only
    L1 = "L1"
    L2 = "L2"


@dataclass(frozen=True)
class Binlog:
    log_id: int
    path: str  # key relative to the storage root
    entries: int
    ts_from: int
    ts_to: int
    size_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "log_id": self.log_id,
            "path": self.path,
            "entries": self.entries,
            "ts_from": self.ts_from,
            "ts_to": self.ts_to,
            "size_bytes": self.size_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Binlog:
        return cls(
            _get(d, "log_id", int),
            _get(d, "path", str),
            _get(d, "entries", int),
            _get(d, "ts_from", int),
            _get(d, "ts_to", int),
            _get(d, "size_bytes", int),
        )


@dataclass(frozen=True)
class ColumnGroupBinlogs:
    """Binlogs of one column group (storage v2): fields stored together in one file."""

    group: int
    field_ids: tuple[int, ...]
    logs: tuple[Binlog, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "field_ids": list(self.field_ids),
            "logs": [b.to_dict() for b in self.logs],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ColumnGroupBinlogs:
        return cls(_get(d, "group", int), _ints(d, "field_ids"), _nested_list(d, "logs", Binlog))


@dataclass(frozen=True)
class SegmentInfo:
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

    def with_changes(self, **changes: Any) -> SegmentInfo:
        return replace(self, **changes)

    @property
    def binlog_files(self) -> list[Binlog]:
        return [b for g in self.binlogs for b in g.logs]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "collection_id": self.collection_id,
            "partition_id": self.partition_id,
            "vchannel": self.vchannel,
            "state": self.state.value,
            "level": self.level.value,
            "num_rows": self.num_rows,
            "max_rows": self.max_rows,
            "binlogs": [g.to_dict() for g in self.binlogs],
            "deltalogs": [b.to_dict() for b in self.deltalogs],
            "statslogs": [b.to_dict() for b in self.statslogs],
            "start_position": self.start_position.to_dict() if self.start_position else None,
            "dml_position": self.dml_position.to_dict() if self.dml_position else None,
            "compaction_from": list(self.compaction_from),
            "is_sorted": self.is_sorted,
            "last_flush_ts": self.last_flush_ts,
            "created_at": self.created_at,
            "last_insert_at": self.last_insert_at,
            "seal_ts": self.seal_ts,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SegmentInfo:
        return cls(
            id=_get(d, "id", int),
            collection_id=_get(d, "collection_id", int),
            partition_id=_get(d, "partition_id", int),
            vchannel=_get(d, "vchannel", str),
            state=_enum(d, "state", SegmentState),
            level=_enum(d, "level", SegmentLevel, SegmentLevel.L1.value),
            num_rows=_get(d, "num_rows", int, 0),
            max_rows=_get(d, "max_rows", int, 0),
            binlogs=_nested_list(d, "binlogs", ColumnGroupBinlogs),
            deltalogs=_nested_list(d, "deltalogs", Binlog),
            statslogs=_nested_list(d, "statslogs", Binlog),
            start_position=_nested(d, "start_position", MsgPosition, None),
            dml_position=_nested(d, "dml_position", MsgPosition, None),
            compaction_from=_ints(d, "compaction_from"),
            is_sorted=_get(d, "is_sorted", bool, False),
            last_flush_ts=_get(d, "last_flush_ts", int, 0),
            created_at=_get(d, "created_at", float, 0.0),
            last_insert_at=_get(d, "last_insert_at", float, 0.0),
            seal_ts=_get(d, "seal_ts", int, 0),
        )


# --- sessions, leases and watch infos ----------------------------------------------------


@dataclass(frozen=True)
class NodeSession:
    node_id: int
    address: str
    version: str
    started_at: float
    state: str = "HEALTHY"

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "version": self.version,
            "started_at": self.started_at,
            "state": self.state,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeSession:
        return cls(
            _get(d, "node_id", int),
            _get(d, "address", str),
            _get(d, "version", str),
            _get(d, "started_at", float),
            _get(d, "state", str, "HEALTHY"),
        )


@dataclass(frozen=True)
class ChannelLease:
    """Who may write a channel's meta: `channel-lease/{vchannel}`."""

    lease_id: int
    node_id: int
    granted_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "node_id": self.node_id, "granted_at": self.granted_at}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChannelLease:
        return cls(_get(d, "lease_id", int), _get(d, "node_id", int), _get(d, "granted_at", float))


class WatchState(enum.StrEnum):
    TO_WATCH = "ToWatch"
    WATCH_SUCCESS = "WatchSuccess"
    WATCH_FAILURE = "WatchFailure"
    TO_RELEASE = "ToRelease"
    RELEASE_SUCCESS = "ReleaseSuccess"
    RELEASE_FAILURE = "ReleaseFailure"


@dataclass(frozen=True)
class VchannelInfo:
    collection_id: int
    channel_name: str
    seek_position: MsgPosition | None = None
    unflushed_segment_ids: tuple[int, ...] = ()
    flushed_segment_ids: tuple[int, ...] = ()
    dropped_segment_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "collection_id": self.collection_id,
            "channel_name": self.channel_name,
            "seek_position": self.seek_position.to_dict() if self.seek_position else None,
            "unflushed_segment_ids": list(self.unflushed_segment_ids),
            "flushed_segment_ids": list(self.flushed_segment_ids),
            "dropped_segment_ids": list(self.dropped_segment_ids),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VchannelInfo:
        return cls(
            collection_id=_get(d, "collection_id", int),
            channel_name=_get(d, "channel_name", str),
            seek_position=_nested(d, "seek_position", MsgPosition, None),
            unflushed_segment_ids=_ints(d, "unflushed_segment_ids"),
            flushed_segment_ids=_ints(d, "flushed_segment_ids"),
            dropped_segment_ids=_ints(d, "dropped_segment_ids"),
        )


@dataclass(frozen=True)
class ChannelWatchInfo:
    vchan: VchannelInfo
    state: WatchState
    start_ts: float
    timeout_ts: float
    progress: int = 0
    op_id: int = 0
    lease_id: int | None = None  # None: written by an older coordinator
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "vchan": self.vchan.to_dict(),
            "state": self.state.value,
            "start_ts": self.start_ts,
            "timeout_ts": self.timeout_ts,
            "progress": self.progress,
            "op_id": self.op_id,
            "lease_id": self.lease_id,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChannelWatchInfo:
        return cls(
            vchan=_nested(d, "vchan", VchannelInfo),
            state=_enum(d, "state", WatchState),
            start_ts=_get(d, "start_ts", float),
            timeout_ts=_get(d, "timeout_ts", float),
            progress=_get(d, "progress", int, 0),
            op_id=_get(d, "op_id", int, 0),
            lease_id=_get(d, "lease_id", int, None),
            reason=_get(d, "reason", str, ""),
        )


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
