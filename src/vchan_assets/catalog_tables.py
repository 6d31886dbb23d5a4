"""The catalog's tables, each declared once by its Arrow schema, and the rows that fill them.

    COLLECTIONS, VCHANNELS, SEGMENTS, COMPACTIONS, DATA_LOSSES, IMPORTS, INDEXES,
    BINLOGS, DELTALOGS (and statslogs: the same columns)

A `Table` builds its frame from its schema (`pa.Table.from_pylist(rows, schema=...)`, as
PyIceberg's inspect tables do), so an empty table has the columns and dtypes of a full one.
The pandas dtype of a column follows its Arrow field alone, never the rows:

| Arrow field                 | pandas dtype                                   |
|-----------------------------|------------------------------------------------|
| int64, not null             | int64                                          |
| int64, nullable             | Int64 (pandas' nullable integer: <NA>)         |
| bool (never null here)      | bool                                           |
| float64                     | float64 (NaN for null)                         |
| timestamp[ns, UTC]          | datetime64[ns, UTC] (NaT for null)             |
| string                      | object: str (None for null)                    |
| list, map                   | object: Python lists, dicts                    |

The row functions here turn the records of etcd (`model`, plans, jobs, index progress)
into rows; the catalog reads the records (and the logs, for a vchannel's row).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa

from vchan_assets.imports.jobs import ImportJob
from vchan_assets.indexes.meta import IndexProgress, progress_row
from vchan_assets.lifecycle.plans import CompactionPlan
from vchan_assets.model import (
    Binlog,
    CollectionInfo,
    ColumnGroupBinlogs,
    DataLoss,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    physical_ms,
)

INT = pa.int64()
STR = pa.string()
FLOAT = pa.float64()
BOOL = pa.bool_()
TIME = pa.timestamp("ns", tz="UTC")
INTS = pa.list_(INT)
STRS = pa.list_(STR)


def _col(name: str, kind: pa.DataType) -> pa.Field:
    """A column every row fills."""
    return pa.field(name, kind, nullable=False)


def _maybe(name: str, kind: pa.DataType) -> pa.Field:
    """A column that may be null (unknown, or not applicable to the row)."""
    return pa.field(name, kind, nullable=True)


@dataclass(frozen=True)
class Table:
    """One catalog table: its name and Arrow schema. Every frame of it has the schema's
    columns in its order, with the dtypes of the module docstring's table."""

    name: str
    schema: pa.Schema

    def arrow(self, rows: Iterable[Mapping[str, Any]]) -> pa.Table:
        """The rows as an Arrow table of the schema: ValueError if a row's keys are not
        the schema's columns, or a not-null column holds a null."""
        rows = list(rows)
        names = set(self.schema.names)
        for row in rows:
            if row.keys() != names:
                odd = sorted(names.symmetric_difference(row))
                raise ValueError(f"a row of the {self.name} table does not match its schema: {odd}")
        table = pa.Table.from_pylist(rows, schema=self.schema)
        for field in self.schema:
            if not field.nullable and table[field.name].null_count:
                raise ValueError(f"column {field.name!r} of the {self.name} table is null in a row")
        return table

    def frame(self, rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
        """The rows as a pandas DataFrame with the schema's columns and dtypes."""
        return self.pandas(self.arrow(rows))

    def pandas(self, table: pa.Table) -> pd.DataFrame:
        """A table of this schema (or some of its columns, as a stored copy holds them)
        as a DataFrame with the dtypes of the schema."""
        columns = {}
        for name in table.column_names:
            field = self.schema.field(name) if name in self.schema.names else table.schema.field(name)
            columns[name] = _series(table[name].cast(field.type), field)
        return pd.DataFrame(columns, columns=table.column_names)


_NULLABLE_INT = {INT: pd.Int64Dtype()}


def _series(column: pa.ChunkedArray, field: pa.Field) -> pd.Series:
    kind = field.type
    if pa.types.is_list(kind):
        return pd.Series(column.to_pylist(), dtype=object)
    if pa.types.is_map(kind):
        return column.to_pandas(maps_as_pydicts="strict")
    if field.nullable and pa.types.is_integer(kind):
        return column.to_pandas(types_mapper=_NULLABLE_INT.get)
    return column.to_pandas()


# --- times ---------------------------------------------------------------------------------


def ts_seconds(ts: int) -> float:
    """A hybrid timestamp as Unix seconds."""
    return physical_ms(ts) / 1000.0


def utc(seconds: float | None) -> pd.Timestamp | None:
    """Unix seconds as a UTC time; None for 0 or None (not recorded)."""
    if not seconds:
        return None
    return pd.Timestamp(seconds, unit="s", tz="UTC")


# --- collections ---------------------------------------------------------------------------

COLLECTIONS = Table(
    "collections",
    pa.schema(
        [
            _col("collection_id", INT),
            _col("name", STR),
            _col("fields", STR),
            _maybe("partition_key", STR),
            _col("ttl_seconds", INT),
            _col("partitions", STRS),
            _col("vchannels", STRS),
            _col("num_vchannels", INT),
            _col("segments", INT),
            _col("rows", INT),
            _col("deletes", INT),
            _maybe("created_at", TIME),
            _col("dropped", BOOL),
        ]
    ),
)


def collection_row(info: CollectionInfo, segments: Iterable[SegmentInfo]) -> dict[str, Any]:
    """`info` with the counts of its live segments (`segments`: its own, any state)."""
    mine = [s for s in segments if s.state is not SegmentState.DROPPED]
    return {
        "collection_id": info.id,
        "name": info.name,
        "fields": ", ".join(f"{f.name}:{f.spec}" for f in info.schema.fields),
        "partition_key": info.schema.partition_key.name if info.schema.partition_key else None,
        "ttl_seconds": info.ttl_seconds,
        "partitions": list(info.partition_names),
        "vchannels": list(info.vchannels),
        "num_vchannels": len(info.vchannels),
        "segments": sum(1 for s in mine if s.level is not SegmentLevel.L0),
        "rows": sum(s.num_rows for s in mine if s.level is not SegmentLevel.L0),
        "deletes": sum(s.num_rows for s in mine if s.level is SegmentLevel.L0),
        "created_at": utc(info.created_at),
        "dropped": bool(info.dropped_at),
    }


# --- vchannels (rows made by the catalog: they read the logs) ----------------------------------

VCHANNELS = Table(
    "vchannels",
    pa.schema(
        [
            _col("vchannel", STR),
            _col("collection", STR),
            _col("collection_id", INT),
            _maybe("owner_node", STR),
            _col("owner_alive", BOOL),
            _maybe("watch_state", STR),
            _maybe("watch_timeout_at", TIME),
            _maybe("lease_id", INT),
            _maybe("lease_node", INT),
            _maybe("checkpoint_offset", INT),
            _maybe("checkpoint_ts", INT),
            _maybe("checkpoint_time", TIME),
            _col("syncs", INT),
            _maybe("head_offset", INT),
            _maybe("head_ts", INT),
            _maybe("head_time", TIME),
            _maybe("end_offset", INT),
            _maybe("lag_rows", INT),
            _maybe("lag_seconds", FLOAT),
            _maybe("checkpoint_age_seconds", FLOAT),
            _col("log_files", INT),
            _col("log_bytes", INT),
            _maybe("backlog_bytes", INT),
            _col("log_error", STR),
            _col("log_damaged", STRS),
        ]
    ),
)

# --- segments ------------------------------------------------------------------------------

SEGMENTS = Table(
    "segments",
    pa.schema(
        [
            _col("segment_id", INT),
            _maybe("collection", STR),
            _col("collection_id", INT),
            _col("partition_id", INT),
            _col("vchannel", STR),
            _col("state", STR),
            _col("level", STR),
            _col("num_rows", INT),
            _col("max_rows", INT),
            _col("size_bytes", INT),
            _col("delta_bytes", INT),
            _col("stats_bytes", INT),
            _col("binlog_count", INT),
            _col("deltalog_count", INT),
            _col("statslog_count", INT),
            _col("column_groups", INT),
            _col("is_sorted", BOOL),
            _col("invisible", BOOL),
            _col("compaction_from", INTS),
            _maybe("start_offset", INT),
            _maybe("dml_offset", INT),
            _maybe("dml_ts", INT),
            _maybe("created_at", TIME),
            _maybe("last_flush_time", TIME),
            _maybe("flushed_at", TIME),
            _maybe("flush_to_sorted_s", FLOAT),
        ]
    ),
)


def segment_row(seg: SegmentInfo, collection: str | None) -> dict[str, Any]:
    """One segment (`collection`: its collection's name, None if unknown)."""
    insert = seg.binlog_files
    return {
        "segment_id": seg.id,
        "collection": collection,
        "collection_id": seg.collection_id,
        "partition_id": seg.partition_id,
        "vchannel": seg.vchannel,
        "state": seg.state.value,
        "level": seg.level.value,
        "num_rows": seg.num_rows,
        "max_rows": seg.max_rows,
        "size_bytes": sum(b.size_bytes for b in insert),
        "delta_bytes": sum(b.size_bytes for b in seg.deltalogs),
        "stats_bytes": sum(b.size_bytes for b in seg.statslogs),
        "binlog_count": len(insert),
        "deltalog_count": len(seg.deltalogs),
        "statslog_count": len(seg.statslogs),
        "column_groups": len(seg.binlogs),
        "is_sorted": seg.is_sorted,
        "invisible": seg.is_invisible,
        "compaction_from": list(seg.compaction_from),
        "start_offset": seg.start_position.offset if seg.start_position else None,
        "dml_offset": seg.dml_position.offset if seg.dml_position else None,
        "dml_ts": seg.dml_position.timestamp if seg.dml_position else None,
        "created_at": utc(seg.created_at),
        "last_flush_time": utc(ts_seconds(seg.last_flush_ts)) if seg.last_flush_ts else None,
        "flushed_at": utc(seg.flushed_at),
        "flush_to_sorted_s": seg.flush_to_sorted,
    }


# --- compactions ---------------------------------------------------------------------------

COMPACTIONS = Table(
    "compactions",
    pa.schema(
        [
            _col("plan_id", INT),
            _maybe("collection", STR),
            _col("partition_id", INT),
            _col("vchannel", STR),
            _col("type", STR),
            _col("state", STR),
            _col("reason", STR),
            _col("inputs", INTS),
            _col("outputs", INTS),
            _col("rows_in", INT),
            _col("rows_out", INT),
            _col("bytes_in", INT),
            _col("bytes_out", INT),
            _maybe("created_at", TIME),
            _maybe("finished_at", TIME),
        ]
    ),
)


def plan_row(p: CompactionPlan, collection: str | None) -> dict[str, Any]:
    return {
        "plan_id": p.plan_id,
        "collection": collection,
        "partition_id": p.partition_id,
        "vchannel": p.vchannel,
        "type": p.type.value,
        "state": p.state.value,
        "reason": p.reason,
        "inputs": list(p.input_ids),
        "outputs": list(p.output_ids),
        "rows_in": p.rows_in,
        "rows_out": p.rows_out,
        "bytes_in": p.bytes_in,
        "bytes_out": p.bytes_out,
        "created_at": utc(p.created_at),
        "finished_at": utc(p.finished_at),
    }


# --- data losses ---------------------------------------------------------------------------

DATA_LOSSES = Table(
    "data_losses",
    pa.schema(
        [
            _col("loss_id", INT),
            _col("collection", STR),
            _col("kind", STR),
            _col("vchannel", STR),
            _col("first_offset", INT),
            _col("last_offset", INT),
            _col("messages", INT),
            _col("segment_id", INT),
            _col("rows", INT),
            _col("path", STR),
            _col("moved_to", STR),
            _col("reason", STR),
            _maybe("at", TIME),
        ]
    ),
)


def loss_row(loss: DataLoss, collection: str) -> dict[str, Any]:
    return {
        "loss_id": loss.loss_id,
        "collection": collection,
        "kind": loss.kind,
        "vchannel": loss.vchannel,
        "first_offset": loss.first_offset,
        "last_offset": loss.last_offset,
        "messages": loss.messages,
        "segment_id": loss.segment_id,
        "rows": loss.rows,
        "path": loss.path,
        "moved_to": loss.moved_to,
        "reason": loss.reason,
        "at": utc(loss.at),
    }


# --- bulk import jobs ----------------------------------------------------------------------

IMPORTS = Table(
    "imports",
    pa.schema(
        [
            _col("job_id", INT),
            _col("collection", STR),
            _col("partition", STR),
            _col("format", STR),
            _col("state", STR),
            _col("reason", STR),
            _col("progress", INT),
            _col("files", INT),
            _col("rows", INT),
            _col("bytes", INT),
            _col("imported_rows", INT),
            _col("segments", INTS),
            _col("attempt", INT),
            _col("upsert", BOOL),
            _maybe("created_at", TIME),
            _maybe("finished_at", TIME),
        ]
    ),
)


def import_row(j: ImportJob) -> dict[str, Any]:
    return {
        "job_id": j.job_id,
        "collection": j.collection,
        "partition": j.partition,
        "format": j.format.value,
        "state": j.state.value,
        "reason": j.reason,
        "progress": j.progress,
        "files": len(j.files),
        "rows": j.rows,
        "bytes": j.bytes,
        "imported_rows": j.imported_rows,
        "segments": list(j.segment_ids),
        "attempt": j.attempt,
        "upsert": j.upsert,
        "created_at": utc(j.created_at),
        "finished_at": utc(j.finished_at),
    }


# --- vector indexes ------------------------------------------------------------------------

INDEXES = Table(
    "indexes",
    pa.schema(
        [
            _col("collection", STR),
            _col("index_id", INT),
            _col("name", STR),
            _col("field", STR),
            _col("type", STR),
            _col("metric", STR),
            _col("params", pa.map_(STR, INT)),
            _maybe("created_at", TIME),
            _col("indexed_rows", INT),
            _col("total_rows", INT),
            _col("segments", INT),
            _col("finished", INT),
            _col("pending", INT),
            _col("in_progress", INT),
            _col("failed", INT),
            _col("waiting", INT),
            _col("fail_reasons", pa.map_(STR, STR)),
        ]
    ),
)


def index_row(info: CollectionInfo, progress: IndexProgress) -> dict[str, Any]:
    """`indexes.meta.progress_row` (what `describe-index --json` prints), its time as a time."""
    row = progress_row(info, progress)
    return {**row, "created_at": utc(row["created_at"])}


# --- files of segments ---------------------------------------------------------------------

_FILE_FIELDS = [
    _col("segment_id", INT),
    _col("collection_id", INT),
    _col("partition_id", INT),
    _col("vchannel", STR),
    _col("segment_state", STR),
    _col("level", STR),
    _col("log_id", INT),
    _col("path", STR),
    _col("entries", INT),
    _col("ts_from", INT),
    _col("ts_to", INT),
    _col("size_bytes", INT),
]
DELTALOGS = Table("deltalogs", pa.schema(_FILE_FIELDS))  # statslogs too
BINLOGS = Table("binlogs", pa.schema([*_FILE_FIELDS, _col("group", INT), _col("field_ids", INTS)]))


def file_row(seg: SegmentInfo, b: Binlog) -> dict[str, Any]:
    """A delta or stats log file of `seg` (a row of DELTALOGS)."""
    return {
        "segment_id": seg.id,
        "collection_id": seg.collection_id,
        "partition_id": seg.partition_id,
        "vchannel": seg.vchannel,
        "segment_state": seg.state.value,
        "level": seg.level.value,
        "log_id": b.log_id,
        "path": b.path,
        "entries": b.entries,
        "ts_from": b.ts_from,
        "ts_to": b.ts_to,
        "size_bytes": b.size_bytes,
    }


def binlog_row(seg: SegmentInfo, group: ColumnGroupBinlogs, b: Binlog) -> dict[str, Any]:
    """An insert binlog file of `seg`, of one column group (a row of BINLOGS)."""
    return {**file_row(seg, b), "group": group.group, "field_ids": list(group.field_ids)}


TABLES = (COLLECTIONS, VCHANNELS, SEGMENTS, COMPACTIONS, DATA_LOSSES, IMPORTS, INDEXES, BINLOGS, DELTALOGS)
