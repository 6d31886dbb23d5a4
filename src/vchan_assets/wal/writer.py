"""Writing a vchannel's write-ahead log files (docs/architecture.md, "The log"; format in `wal.format`).

One batch = one Parquet file `wal/{vchannel}/{first_offset:020d}.parquet`, published
with an exclusive `Storage.write_atomic` (temporary name + hard link locally, a single
PUT on S3), so a reader sees a whole batch or nothing and no file is ever overwritten:
a writer that finds its file name taken gets `LogConflictError`.

`write_at` writes a batch at an offset someone else decided: the multi-writer path
(`wal.appender`), where the channel's head in etcd says where the log ends. Given a
`DataFile` (`write_data`, written before the offset is known), it writes the format-2
log file: system columns only, naming the data file (`wal.format`). `append`
is the single-writer path (tests, tools): the next offset comes from the last file
(its name plus the `vchan.count` footer entry) and is cached per process, behind one
lock per channel.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vchan_assets.errors import DeclaredError
from vchan_assets.model import CollectionInfo
from vchan_assets.storage import ObjectExistsError, Storage
from vchan_assets.wal import format as fmt
from vchan_assets.wal.format import (
    LogError,
    MsgType,
    SchemaMismatchError,
    check_msg_types,
    check_schema,
    data_key,
    log_schema,
    user_fields,
    wal_key,
)

# Parquet writer settings, measured on 100k rows with a 128-d vector (2 cores):
# vectors are random bytes, so neither compression nor dictionary nor min/max
# statistics buy anything on them; snappy and dictionaries stay on for the small
# columns. Page checksums (~12 ms per 100k rows) let the reader detect a damaged
# page instead of returning garbage.
WRITE_PAGE_CHECKSUM = True


class LogConflictError(DeclaredError, LogError):
    """Another writer appended to the channel: the file this writer was about to write
    already exists, and stays as it is."""

    path: str
    vchannel: str
    message = (
        "log file {path} already exists: another writer appended to {vchannel} "
        "at this offset; nothing was written"
    )


class InvalidBatchError(DeclaredError, LogError):
    """A batch breaks a rule of the log (timestamp order, required fields of a message)."""

    vchannel: str
    reason: str
    message = "batch for {vchannel} rejected, nothing was written: {reason}"


@dataclass(frozen=True)
class WrittenBatch:
    """A log file as a writer sees it when its offset was taken."""

    first_offset: int
    count: int
    last_timestamp: int
    batch_id: str  # "" for files of the single-writer path
    segment_rows: tuple[tuple[int, int], ...]  # (segment_id, insert rows)


@dataclass(frozen=True)
class DataFile:
    """A format-2 data file: the collection's columns of a batch's first `rows` messages
    (its inserts), written before the batch has an offset."""

    key: str
    rows: int
    size_bytes: int


@dataclass
class _ChannelState:
    """Shared by every writer of one channel in this process."""

    lock: threading.RLock
    next_offset: int | None = None  # None: not read from storage yet
    last_timestamp: int = 0


_CHANNELS: dict[tuple[str, str], _ChannelState] = {}
_CHANNELS_LOCK = threading.Lock()


def _channel_state(storage: Storage, vchannel: str) -> _ChannelState:
    key = (storage.uri, vchannel)
    with _CHANNELS_LOCK:
        state = _CHANNELS.get(key)
        if state is None:
            state = _CHANNELS[key] = _ChannelState(threading.RLock())
        return state


def channel_lock(storage: Storage, vchannel: str) -> threading.RLock:
    """The in-process lock of a channel; re-entrant, so a producer can hold it across
    taking a timestamp, assigning segments and appending."""
    return _channel_state(storage, vchannel).lock


class WalWriter:
    """Appends batches to one vchannel's log; see the module docstring for the rules."""

    def __init__(self, storage: Storage, vchannel: str, collection: CollectionInfo) -> None:
        self.storage = storage
        self.vchannel = vchannel
        self.collection = collection
        self.schema = log_schema(collection.schema)
        self._state = _channel_state(storage, vchannel)
        self.data_schema = pa.schema(user_fields(collection.schema))
        self._vector_columns = {f.name for f in collection.schema.vector_fields}
        # Nullable fields may be null in an insert; every other field is filled (a default
        # included) before a batch gets here.
        self._required_for_insert = [f.name for f in collection.schema.fields if not f.nullable]
        self._pk = collection.schema.primary.name

    @property
    def lock(self) -> threading.RLock:
        return self._state.lock

    @property
    def next_offset(self) -> int:
        """Offset the next appended message gets (0 for an empty channel)."""
        with self.lock:
            self._load_tail()
            assert self._state.next_offset is not None
            return self._state.next_offset

    @property
    def last_timestamp(self) -> int:
        """Timestamp of the last message in the channel (0 for an empty channel)."""
        with self.lock:
            self._load_tail()
            return self._state.last_timestamp

    def append(self, table: pa.Table) -> tuple[int, int]:
        """Append one batch as one file; returns (first_offset, last_offset).

        `table` has the log columns without `offset` (any `offset` column is replaced:
        the writer owns offsets); missing nullable columns are filled with nulls.
        Raises SchemaMismatchError, UnknownMessageTypeError or InvalidBatchError
        before anything is written."""
        if table.num_rows == 0:
            raise InvalidBatchError(self.vchannel, "the batch is empty")
        with self.lock:
            self._load_tail()
            first = self._state.next_offset
            assert first is not None
            key = wal_key(self.vchannel, first)
            path = self.storage.path(key)
            batch = self._conform(table, path, first, self.schema)
            last_ts = self._validate(batch, path, first)
            data = self._encode(batch, self._footer(first, batch.num_rows, last_ts))
            try:
                self.storage.write_atomic(key, data, exclusive=True)
            except ObjectExistsError:
                self._state.next_offset = None  # re-read the tail next time
                raise LogConflictError(path, self.vchannel) from None
            self._state.next_offset = first + batch.num_rows
            self._state.last_timestamp = last_ts
            return first, first + batch.num_rows - 1

    def write_at(
        self, table: pa.Table, first: int, after_ts: int, batch_id: str, data: DataFile | None = None
    ) -> tuple[int, int]:
        """Write one batch as the file at offset `first` (its timestamps must be above
        `after_ts`, the channel's last); returns (first_offset, last_timestamp).
        With `data`, `table` has the system columns only and its first `data.rows`
        messages are the inserts whose columns `data` holds (format 2).
        LogConflictError if that file exists; nothing is overwritten."""
        if table.num_rows == 0:
            raise InvalidBatchError(self.vchannel, "the batch is empty")
        key = wal_key(self.vchannel, first)
        path = self.storage.path(key)
        batch = self._conform(table, path, first, self.schema if data is None else fmt.SYSTEM_SCHEMA)
        last_ts = self._validate(batch, path, first, after_ts + 1, data)
        meta = {fmt.META_BATCH: batch_id}
        if data is not None:
            meta |= {
                fmt.META_FORMAT: str(fmt.FORMAT_VERSION),
                fmt.META_DATA: data.key,
                fmt.META_DATA_ROWS: str(data.rows),
                fmt.META_DATA_BYTES: str(data.size_bytes),
            }
        encoded = self._encode(batch, self._footer(first, batch.num_rows, last_ts, meta))
        try:
            self.storage.write_atomic(key, encoded, exclusive=True)
        except ObjectExistsError:
            raise LogConflictError(path, self.vchannel) from None
        return first, last_ts

    def write_data(self, rows: pa.Table, batch_id: str) -> DataFile:
        """Write the data file of batch `batch_id`: `rows` are its inserts, the collection's
        fields in log order (pk first), no nulls but in nullable fields. Needs no lock: a retry of the batch writes
        the same file again, and a file no log file names is garbage."""
        key = data_key(self.vchannel, batch_id)
        path = self.storage.path(key)
        if rows.num_rows == 0:
            raise InvalidBatchError(self.vchannel, "the batch is empty")
        check_schema(path, self.data_schema, rows.schema)
        for name in self._required_for_insert:
            if rows.column(name).null_count:
                raise InvalidBatchError(self.vchannel, f"insert messages need {name!r}")
        rows = pa.Table.from_arrays(rows.columns, schema=self.data_schema)
        meta = {fmt.META_CHANNEL: self.vchannel, fmt.META_BATCH: batch_id}
        encoded = self._encode(rows, {k: v.encode() for k, v in meta.items()})
        self.storage.write_atomic(key, encoded)
        return DataFile(key, rows.num_rows, encoded.size)

    def written_at(self, first: int) -> WrittenBatch | None:
        """What the file at offset `first` holds (None: no such file): for a writer that
        finds its offset taken, and for a retry that looks for its own batch."""
        from vchan_assets.wal.reader import read_log_file

        key = wal_key(self.vchannel, first)
        if not self.storage.exists(key):
            return None
        table = read_log_file(self.storage, key, self.collection.schema, columns=["segment_id"])
        with self.storage.open_input_file(key) as f:
            meta = pq.ParquetFile(f).metadata.metadata or {}
        segments = table.column("segment_id").drop_null().to_numpy()
        ids, counts = np.unique(segments, return_counts=True)
        return WrittenBatch(
            first,
            table.num_rows,
            int(table.column("timestamp")[-1].as_py()),
            meta.get(fmt.META_BATCH, b"").decode(),
            tuple(zip(ids.tolist(), counts.tolist(), strict=True)),
        )

    def tail(self) -> tuple[int, int]:
        """(next offset, last timestamp) of the log as storage holds it (0, 0 if empty)."""
        from vchan_assets.wal.reader import WalReader

        last = WalReader(self.storage, self.vchannel, self.collection).last_file()
        return (0, 0) if last is None else (last.end_offset, last.last_timestamp)

    def refresh(self) -> None:
        """Forget the cached tail: the next append reads it from storage again."""
        with self.lock:
            self._state.next_offset = None

    # --- internals ---------------------------------------------------------------------

    def _load_tail(self) -> None:
        if self._state.next_offset is not None:
            return
        from vchan_assets.wal.reader import WalReader  # the reader validates the footer

        last = WalReader(self.storage, self.vchannel, self.collection).last_file()
        if last is None:
            self._state.next_offset, self._state.last_timestamp = 0, 0
        else:
            self._state.next_offset = last.first_offset + last.count
            self._state.last_timestamp = last.last_timestamp

    def _conform(self, table: pa.Table, path: str, first: int, schema: pa.Schema) -> pa.Table:
        """The batch in `schema`'s column order with the `offset` column, or
        SchemaMismatchError."""
        found = table.schema
        if len(set(found.names)) != len(found.names) or any(n not in schema.names for n in found.names):
            raise SchemaMismatchError(path, schema, found)
        columns: list[pa.ChunkedArray | pa.Array] = []
        bad = False
        for field in schema:
            if field.name == "offset":
                columns.append(pa.array(np.arange(first, first + table.num_rows, dtype=np.int64)))
                continue
            if field.name not in found.names:
                if not field.nullable:
                    bad = True
                    break
                columns.append(pa.nulls(table.num_rows, field.type))
                continue
            column = table.column(field.name)
            if column.type.equals(field.type):
                columns.append(column)
            elif pa.types.is_null(column.type):
                columns.append(pa.nulls(table.num_rows, field.type))
            else:
                bad = True
                break
        if bad:
            raise SchemaMismatchError(path, schema, found)
        return pa.Table.from_arrays(columns, schema=schema)

    def _validate(
        self, batch: pa.Table, path: str, first: int, floor: int | None = None, data: DataFile | None = None
    ) -> int:
        """Message types, required fields and timestamp order; returns the last timestamp.
        With `data` (format 2) the inserts are exactly the first `data.rows` messages (their
        fields are in the data file, checked there) and there are no deletes."""
        for name in ("msg_type", "timestamp"):
            if batch.column(name).null_count:
                raise InvalidBatchError(self.vchannel, f"column {name!r} has nulls")
        kinds = batch.column("msg_type")
        check_msg_types(kinds, path, first)

        floor = self._state.last_timestamp if floor is None else floor
        ts = batch.column("timestamp").to_numpy()
        if ts[0] < floor or (len(ts) > 1 and bool((np.diff(ts) < 0).any())):
            raise InvalidBatchError(
                self.vchannel,
                f"timestamps must not decrease (at least {floor} in the channel, "
                f"batch from {int(ts.min())} to {int(ts.max())})",
            )

        inserts = pc.equal(kinds, MsgType.INSERT.value)
        deletes = pc.equal(kinds, MsgType.DELETE.value)
        if data is None:
            required = [(inserts, "insert", ["segment_id", "partition_id", *self._required_for_insert])]
            required.append((deletes, "delete", ["partition_id", self._pk]))
        else:
            n = data.rows
            if n > len(ts) or not pc.all(inserts.slice(0, n)).as_py() or pc.any(inserts.slice(n)).as_py():
                raise InvalidBatchError(
                    self.vchannel, f"the inserts must be the first {n} messages, as many as the data file has"
                )
            if pc.any(deletes).as_py():
                raise InvalidBatchError(self.vchannel, "a batch with a data file holds no deletes")
            required = [(inserts, "insert", ["segment_id", "partition_id"])]
        for mask, kind, names in required:
            if not pc.any(mask).as_py():
                continue
            for name in names:
                column = batch.column(name)
                if column.null_count and pc.any(pc.and_(mask, pc.is_null(column))).as_py():
                    raise InvalidBatchError(self.vchannel, f"{kind} messages need {name!r}")
        return int(ts[-1])

    def _footer(
        self, first: int, count: int, last_ts: int, extra: dict[bytes, str] | None = None
    ) -> dict[bytes, bytes]:
        meta = {
            fmt.META_CHANNEL: self.vchannel,
            fmt.META_COLLECTION: str(self.collection.id),
            fmt.META_FIRST_OFFSET: str(first),
            fmt.META_COUNT: str(count),
            fmt.META_LAST_TS: str(last_ts),
            **(extra or {}),
        }
        return {k: v.encode() for k, v in meta.items() if v}

    def _encode(self, batch: pa.Table, metadata: dict[bytes, bytes]) -> pa.Buffer:
        batch = batch.replace_schema_metadata(metadata)
        names = batch.column_names
        strings = [n for n in names if pa.types.is_string(batch.schema.field(n).type)]
        sink = pa.BufferOutputStream()
        pq.write_table(
            batch,
            sink,
            compression={n: "none" if n in self._vector_columns else "snappy" for n in names},
            use_dictionary=strings,
            write_statistics=[n for n in names if n not in self._vector_columns],
            write_page_checksum=WRITE_PAGE_CHECKSUM,
        )
        return sink.getvalue()
