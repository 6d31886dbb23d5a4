"""The log's file format (docs/architecture.md, "The log"), shared by the writer, the reader and the sync.

One Parquet file per appended batch: `wal/{vchannel}/{first_offset:020d}.parquet`,
offsets dense and contiguous inside the file and across files. Columns, in order:

    offset        int64     dense per channel, starting at 0
    msg_type      string    one of MsgType
    timestamp     int64     hybrid timestamp from the TSO
    segment_id    int64     insert rows: the segment the row belongs to; else null
    partition_id  int64     insert/delete/partition DDL rows; else null
    payload       string    DDL rows: JSON details; else null
    {pk}          int64     insert and delete rows: the primary key; else null
    {fields...}   the collection's other fields, nullable, as `fields.arrow_type` holds
                  them; float vectors are fixed_size_binary(dim * 4), little-endian
                  float32 (as Milvus stores them)

File key-value metadata: `vchan.channel`, `vchan.collection_id`, `vchan.first_offset`,
`vchan.count`, `vchan.last_timestamp`, and (from the multi-writer producer) `vchan.batch`,
the id its writer gave the batch, so a retried append recognises a file it already wrote.

Format versions (`vchan.format`; absent means 1):

1. every column in the one file (above).
2. a log file with a data file: the log file holds the system columns only (`offset` to
   `payload`) and names, in `vchan.data`, the data file `wal-data/{vchannel}/{batch}.parquet`
   that holds the collection's columns of its first rows (`vchan.data_rows` of them, the
   batch's inserts; later rows, its time tick, have nulls there), `vchan.data_bytes` its
   size. The data file depends on nothing the append lock decides, so a producer writes it
   before taking the lock, which then covers only the small log file (docs/multi-writer.md).
   A data file no log file names (its writer died before publishing) is garbage.
"""

from __future__ import annotations

import enum

import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.errors import DeclaredError
from vchan_assets.fields import arrow_type
from vchan_assets.model import CollectionSchema


class MsgType(enum.StrEnum):
    INSERT = "insert"
    DELETE = "delete"
    TIME_TICK = "timetick"
    CREATE_COLLECTION = "create_collection"
    DROP_COLLECTION = "drop_collection"
    CREATE_PARTITION = "create_partition"
    DROP_PARTITION = "drop_partition"


MSG_TYPES = frozenset(m.value for m in MsgType)

SYSTEM_COLUMNS = ("offset", "msg_type", "timestamp", "segment_id", "partition_id", "payload")

META_CHANNEL = b"vchan.channel"
META_COLLECTION = b"vchan.collection_id"
META_FIRST_OFFSET = b"vchan.first_offset"
META_COUNT = b"vchan.count"
META_LAST_TS = b"vchan.last_timestamp"
META_BATCH = b"vchan.batch"  # optional: the appending client's batch id (a retry recognises its file)
META_FORMAT = b"vchan.format"  # optional: absent for format 1
META_DATA = b"vchan.data"  # format 2: key of the data file
META_DATA_ROWS = b"vchan.data_rows"  # format 2: rows of the data file
META_DATA_BYTES = b"vchan.data_bytes"  # format 2: size of the data file

FORMAT_VERSION = 2  # the newest format this code reads and writes


class LogError(RuntimeError):
    """Base class of errors reading or writing the log."""


class CorruptLogError(DeclaredError, LogError):
    """A log file cannot be read, or its offsets are not what its name promises."""

    path: str
    reason: str
    message = "corrupt log file {path}: {reason}"


class SchemaMismatchError(DeclaredError, LogError):
    """A log file's columns do not match the collection's schema."""

    path: str
    expected: pa.Schema
    found: pa.Schema

    def __str__(self) -> str:
        expected, found = self.expected, self.found
        missing = set(expected.names) - set(found.names)
        extra = set(found.names) - set(expected.names)
        changed = [
            f"{n}: {found.field(n).type} (expected {expected.field(n).type})"
            for n in expected.names
            if n in found.names and not found.field(n).type.equals(expected.field(n).type)
        ]
        detail = "; ".join(
            part
            for part in (
                f"missing {sorted(missing)}" if missing else "",
                f"unexpected {sorted(extra)}" if extra else "",
                f"changed {changed}" if changed else "",
            )
            if part
        )
        return f"log file {self.path} does not match the collection schema: {detail}"


class UnknownMessageTypeError(DeclaredError, LogError):
    path: str
    offset: int
    msg_type: str

    def __str__(self) -> str:
        return (
            f"log file {self.path}: message at offset {self.offset} has unknown type {self.msg_type!r}; "
            f"known: {sorted(MSG_TYPES)}"
        )


_MSG_TYPE_SET = pa.array(sorted(MSG_TYPES))


def check_schema(path: str, expected: pa.Schema, found: pa.Schema) -> None:
    """SchemaMismatchError unless `found` has exactly `expected`'s columns, in order and of
    the same types (a log file, a data file, or a batch about to become one)."""
    if found.names != expected.names or any(
        not found.field(n).type.equals(expected.field(n).type) for n in expected.names
    ):
        raise SchemaMismatchError(path, expected, found)


def check_msg_types(kinds: pa.Array | pa.ChunkedArray, path: str, first: int) -> None:
    """UnknownMessageTypeError for the first of `kinds` (a batch's msg_type column, no
    nulls, offsets from `first`) that is not a MsgType."""
    known = pc.is_in(kinds, value_set=_MSG_TYPE_SET)
    if not pc.all(known).as_py():
        index = pc.index(known, False).as_py()
        raise UnknownMessageTypeError(path, first + index, kinds[index].as_py())


def user_fields(schema: CollectionSchema) -> list[pa.Field]:
    """The collection's fields as Arrow fields: primary key first, then the rest in order."""
    ordered = [schema.primary] + [f for f in schema.fields if not f.is_primary]
    return [pa.field(f.name, arrow_type(f), nullable=True) for f in ordered]


SYSTEM_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("msg_type", pa.string(), nullable=False),
        pa.field("timestamp", pa.int64(), nullable=False),
        pa.field("segment_id", pa.int64()),
        pa.field("partition_id", pa.int64()),
        pa.field("payload", pa.string()),
    ]
)


def log_schema(schema: CollectionSchema) -> pa.Schema:
    return pa.schema([*SYSTEM_SCHEMA, *user_fields(schema)])


def wal_prefix(vchannel: str) -> str:
    return f"wal/{vchannel}/"


def wal_key(vchannel: str, first_offset: int) -> str:
    return f"wal/{vchannel}/{first_offset:020d}.parquet"


def data_key(vchannel: str, batch_id: str) -> str:
    """Key of a format-2 data file: outside `wal/{vchannel}/`, so listings of the log
    see log files only."""
    return f"wal-data/{vchannel}/{batch_id}.parquet"


def data_prefix(vchannel: str) -> str:
    return f"wal-data/{vchannel}/"


def first_offset_of(key: str) -> int:
    """First offset of a log file from its name; raises ValueError for other names."""
    name = key.rsplit("/", 1)[-1]
    if not name.endswith(".parquet") or len(name) != 28 or not name[:20].isdigit():
        raise ValueError(f"not a log file name: {name}")
    return int(name[:20])
