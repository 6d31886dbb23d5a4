"""`spark.readStream.format("vchan")`: a collection's changes, every insert and delete of
its log in order, exactly once into a sink with Spark's checkpoint
(docs/streams.md).

    (spark.readStream.format("vchan")
        .option("collection", "books")
        .option("streamId", "books-to-lake")      # required: names the stream in etcd
        .option("startingOffsets", "earliest")    # earliest (default), latest, a time, or offsets JSON
        .option("upTo", "checkpoint")             # checkpoint (default: persisted only) or head
        .option("maxRowsPerTrigger", "100000")    # optional: about this many log messages a batch
        .option("fields", "title")                # optional: the user fields (the pk always)
        .option("vectors", "array")               # array<float> (default) or binary
        .load()
        .writeStream.format("parquet").option("checkpointLocation", ...).start(path))

Rows: `op` ("insert" or "delete"), `ts` (hybrid timestamp), `vchannel`, `offset`,
`partition_id`, the primary key, then the chosen fields (null in a delete's row).

**Offsets** are the vchannels' log offsets, a JSON map vchannel -> the last offset read
(-1: nothing); a micro-batch from `start` to `end` holds the inserts and deletes at
offsets in (start, end] of each vchannel, in offset order within a vchannel (one Spark
partition per vchannel and about `PARTITION_MESSAGES` messages; the `offset` column
orders them downstream). The log is immutable, so Spark replaying a batch from its
checkpoint reads the same rows: with a sink that commits by batch (Parquet, Delta, a
`foreachBatch` keyed by batch id) every change lands exactly once.

- `startingOffsets` (a new query only; a restart continues from Spark's checkpoint):
  `earliest`, the oldest offset log retention kept; `latest`, where `upTo` stands now
  (only later changes); a time (ISO-8601, or a hybrid timestamp), the first message at
  or after it; or a JSON map of offsets as above.
- `upTo`: `checkpoint` reads up to each channel checkpoint, what a sync has persisted
  in binlogs (the default, what a batch read of the segments also sees); `head` reads
  everything appended, up to the log's end (lower latency; a change is read before it is
  synced, and is never rolled back: the log is the source of truth).
- `maxRowsPerTrigger` caps a micro-batch at about that many log messages, counting time
  ticks, shared among the vchannels with something to read, in whole log files (at least
  one per vchannel): a batch can hold up to one file per vchannel more.
  `trigger(availableNow=True)` honours it (several batches up to what was there at start).

The offsets are found from the log files' names and footers (`WalReader.files_after`):
planning opens no data, and no file before the start. An offset log retention removed
already fails with `StreamOffsetRemovedError`, naming the oldest offset still readable.
A collection dropped while streamed is read to the end of its log (its checkpoints no
longer move), then the stream fails with `StreamCollectionDroppedError`.

**Stream registration** (`datacoord.streams`): the `streamId` option names the stream in
etcd, `meta/stream/{streamId}`. Spark gives a Python source no checkpoint location, so
the id cannot be derived from it: give one id per streaming query, stable across its
restarts (as its checkpoint location is). The first planning registers the stream at its
start offsets, each Spark commit records the end offsets of the batch the sink holds
(Spark commits a batch when it plans the next one: the record lags a batch, which only
holds more back), and log retention keeps what follows until the stream has not been
seen for VCHAN_STREAM_IDLE_TIMEOUT. `vchan status` lists the streams.

Connection options are those of the batch reader (`query.spark_source`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import LongType, StringType, StructField, StructType

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.datacoord.streams import (
    TOUCH_INTERVAL,
    record_stream,
    touch_stream,
    valid_stream_id,
)
from vchan_assets.errors import DeclaredError
from vchan_assets.failpoints import failpoint
from vchan_assets.model import CollectionInfo, FieldSchema
from vchan_assets.query.asof import TimeTravelError, parse_time
from vchan_assets.query.source_options import (
    ReadOptionError,
    ReadRequest,
    field_column,
    selected_fields,
    settings_from_options,
    spark_type,
)
from vchan_assets.stack import Stack
from vchan_assets.storage import Storage
from vchan_assets.wal.format import CorruptLogError, MsgType, first_offset_of, wal_prefix
from vchan_assets.wal.reader import WalFile, WalReader, read_log_file

STREAM_ID_OPTION = "streamid"
# The stream's options (lower case, as Spark passes them), and the batch reader's that a
# stream does not take: either is named in the error an unknown option raises.
STREAM_OPTIONS = (
    "collection",
    "streamId",
    "startingOffsets",
    "upTo",
    "maxRowsPerTrigger",
    "fields",
    "vectors",
)
BATCH_ONLY_OPTIONS = ("partition", "segments", "task_mb", "as_of", "pks", "pk_min", "pk_max")
UP_TO = ("checkpoint", "head")
CHANGE_COLUMNS = ("op", "ts", "vchannel", "offset", "partition_id")
PARTITION_MESSAGES = 262_144  # log messages of one Spark task, at most (whole files; one file at least)
BATCH_ROWS = 65_536
_CHANGES = pa.array([MsgType.INSERT.value, MsgType.DELETE.value])

Offsets = dict[str, int]


class StreamOffsetError(DeclaredError, ValueError):
    """Offsets (an option, or Spark's checkpoint) that are not this collection's."""

    offsets: str
    reason: str
    message = "stream offsets {offsets}: {reason}"


class StreamOffsetRemovedError(DeclaredError, LookupError):
    """A stream would read an offset that log retention has removed."""

    vchannel: str
    offset: int
    oldest: int
    message = (
        "vchannel {vchannel}: offset {offset} was removed by log retention; the oldest offset "
        "still readable is {oldest} (a stream unseen for VCHAN_STREAM_IDLE_TIMEOUT stops "
        "holding the log back; restart it from startingOffsets=earliest with a new checkpoint)"
    )


class StreamCollectionDroppedError(DeclaredError, LookupError):
    """The streamed collection was dropped, and the stream has read all of its log."""

    collection: str
    collection_id: int
    offsets: str
    message = (
        "collection {collection!r} (id {collection_id}) was dropped while streamed: every change "
        "up to its drop has been read (offsets {offsets}); stop the stream"
    )


@dataclass(frozen=True)
class StreamRequest:
    """The options of one change stream, checked."""

    read: ReadRequest  # collection, fields, vectors: as the batch reader takes them
    stream_id: str
    starting: str = "earliest"
    up_to: str = "checkpoint"
    max_rows: int = 0  # 0: no cap

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> StreamRequest:
        opts = {k.lower(): v for k, v in options.items()}
        _check_known(opts)
        stream_id = opts.get(STREAM_ID_OPTION, "").strip()
        if not stream_id:
            raise ReadOptionError(
                'readStream.format("vchan") needs .option("streamId", ID): one id per streaming '
                "query, kept across its restarts; it names the stream whose commits hold back log retention"
            )
        if not valid_stream_id(stream_id):
            raise ReadOptionError(
                f"option streamId={stream_id!r}: expected letters, digits, '.', '_' or '-' (128 at most)"
            )
        read = ReadRequest.from_options(
            {k: v for k, v in opts.items() if k in ("collection", "fields", "vectors")}
        )
        up_to = opts.get("upto", "checkpoint").strip().lower()
        if up_to not in UP_TO:
            raise ReadOptionError(f"option upTo={up_to!r}: expected one of {', '.join(UP_TO)}")
        raw_max = opts.get("maxrowspertrigger", "0").strip()
        try:
            max_rows = int(raw_max)
        except ValueError:
            max_rows = -1
        if max_rows < 0:
            raise ReadOptionError(f"option maxRowsPerTrigger={raw_max!r}: expected a number of rows > 0")
        starting = opts.get("startingoffsets", "earliest").strip()
        return cls(read, stream_id, starting.lower() if starting.isalpha() else starting, up_to, max_rows)


def _check_known(opts: Mapping[str, str]) -> None:
    """Every option is the stream's or a setting (VCHAN_*): a misspelt one fails, naming it."""
    known = {o.lower() for o in STREAM_OPTIONS}
    unknown = sorted(k for k in opts if k not in known and not k.upper().startswith("VCHAN_"))
    if not unknown:
        return
    batch = [k for k in unknown if k in BATCH_ONLY_OPTIONS]
    raise ReadOptionError(
        f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
        f'readStream.format("vchan"): expected {", ".join(STREAM_OPTIONS)} or VCHAN_* settings'
        + (f" ({', '.join(batch)}: options of the batch reader, spark.read)" if batch else "")
    )


def stream_schema(info: CollectionInfo, request: ReadRequest) -> StructType:
    # All nullable, as the Arrow batches `read` yields are (the change columns never are null).
    fields = [
        StructField("op", StringType()),
        StructField("ts", LongType()),
        StructField("vchannel", StringType()),
        StructField("offset", LongType()),
        StructField("partition_id", LongType()),
    ]
    fields += [StructField(f.name, spark_type(f, request.vectors)) for f in selected_fields(info, request)]
    return StructType(fields)


def parse_offsets(raw: Any, vchannels: Sequence[str]) -> Offsets:
    """A JSON map (or a dict) of an offset >= -1 for each of `vchannels`, and no other."""
    text = raw if isinstance(raw, str) else json.dumps(raw)
    try:
        found = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        raise StreamOffsetError(text[:200], f"not JSON ({exc})") from None
    if not isinstance(found, dict):
        raise StreamOffsetError(text[:200], "expected a JSON object vchannel -> offset")
    missing = sorted(set(vchannels) - set(found))
    unknown = sorted(set(found) - set(vchannels))
    if missing or unknown:
        raise StreamOffsetError(
            text[:200],
            f"the collection's vchannels are {sorted(vchannels)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not the collection's {unknown}" if unknown else "")
            + " (offsets of another collection, or of one dropped and created again under its name:"
            " start the stream afresh, with a new checkpoint)",
        )
    bad = {v: o for v, o in found.items() if isinstance(o, bool) or not isinstance(o, int) or o < -1}
    if bad:
        raise StreamOffsetError(text[:200], f"offsets must be integers >= -1, found {bad}")
    return {v: int(found[v]) for v in vchannels}


@dataclass(frozen=True)
class LogSlice:
    """Log files of one vchannel, from a partition's start to its end."""

    key: str
    first_offset: int
    count: int


class ChangesPartition(InputPartition):
    """One Spark task: the changes of one vchannel at offsets in (start, end], from `files`."""

    def __init__(self, vchannel: str, start: int, end: int, files: Sequence[LogSlice]) -> None:
        super().__init__((vchannel, start, end))
        self.vchannel, self.start, self.end = vchannel, start, end
        self.files = tuple(files)


def _meta(settings: Settings) -> Stack:
    return Stack.open(settings, start_etcd=False)


class VchanStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans on the driver's Python worker (one object for the life of the query: it keeps
    an etcd connection and the log footers it has read); `read` runs in the tasks, with
    only what `ChangesPartition` carries and the collection schema."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.request = StreamRequest.from_options(options)
        self.settings = settings_from_options(options)
        self.storage = Storage.from_settings(self.settings)
        stack = _meta(self.settings)
        try:
            self.info = CollectionRegistry(stack.store).get_by_name(self.request.read.collection)
        finally:
            stack.close()
        self.fields = selected_fields(self.info, self.request.read)
        self._stack: Stack | None = None
        self._logs: dict[str, WalReader] = {}
        self._available_now = False
        self._target: Offsets | None = None  # trigger(availableNow): where the stream stops
        self._touched = 0.0

    def __getstate__(self) -> dict[str, Any]:
        # Tasks get the reader pickled: no connection, no planning state.
        return {**self.__dict__, "_stack": None, "_logs": {}}

    # --- planning (driver) -----------------------------------------------------------

    @property
    def store(self) -> Any:
        if self._stack is None:
            self._stack = _meta(self.settings)
        return self._stack.store

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def _log(self, vchannel: str) -> WalReader:
        if vchannel not in self._logs:
            self._logs[vchannel] = WalReader(self.storage, vchannel, self.info)
        return self._logs[vchannel]

    def _oldest(self, vchannel: str) -> int | None:
        """First offset log retention kept (None: no log file), from the names alone."""
        for key in self.storage.list_keys(wal_prefix(vchannel)):
            try:
                return first_offset_of(key)
            except ValueError:
                continue
        return None

    def _check_retained(self, offsets: Offsets) -> None:
        for vchannel, offset in offsets.items():
            oldest = self._oldest(vchannel)
            if oldest is not None and offset + 1 < oldest:
                raise StreamOffsetRemovedError(vchannel, offset + 1, oldest)

    def _bound(self, vchannel: str, start: int, head: bool) -> int:
        """The last offset the stream may read now: the channel checkpoint, or with `head`
        the log's last message."""
        if not head:
            cp = channel_checkpoint(self.store, vchannel)
            return -1 if cp is None else cp.model.offset
        files = self._log(vchannel).files_after(start)
        return files[-1].last_offset if files else start

    def _bounds(self, start: Offsets, head: bool | None = None) -> Offsets:
        head = self.request.up_to == "head" if head is None else head
        return {v: self._bound(v, o, head) for v, o in start.items()}

    def _dropped(self) -> bool:
        """The collection was dropped: no sync moves its checkpoints any more, so the
        stream reads the rest of its log up to the head, then stops with an error."""
        return bool(CollectionRegistry(self.store).get(self.info.id, include_dropped=True).dropped_at)

    def _offsets(self, raw: Any) -> Offsets:
        return parse_offsets(raw, self.info.vchannels)

    def initialOffset(self) -> dict:
        starting = self.request.starting
        everything = dict.fromkeys(self.info.vchannels, -1)
        if starting == "earliest":
            found = {v: (o - 1 if (o := self._oldest(v)) is not None else -1) for v in self.info.vchannels}
        elif starting == "latest":
            found = self._bounds(everything)
        elif starting.startswith(("{", "[")):
            found = self._offsets(starting)
            self._check_retained(found)
        else:
            try:
                ts = parse_time(starting)
            except TimeTravelError:
                raise ReadOptionError(
                    f"option startingOffsets={starting!r}: expected earliest, latest, a time "
                    '(ISO-8601 or a hybrid timestamp) or offsets as JSON {"vchannel": offset}'
                ) from None
            found = {v: self._before(v, ts) for v in self.info.vchannels}
        return found

    def _before(self, vchannel: str, ts: int) -> int:
        """The offset before the first message at or after `ts` (the log's last offset if
        none is): footers first, then the timestamps of the one file that holds it."""
        files = self._log(vchannel).files()
        for f in files:
            if f.last_timestamp < ts:
                continue
            stamps = read_log_file(self.storage, f.key, self.info.schema, columns=[]).column("timestamp")
            first = int(pc.index(pc.greater_equal(stamps, ts), True).as_py())
            return f.first_offset + max(first, 0) - 1
        return files[-1].last_offset if files else -1

    def prepareForTriggerAvailableNow(self) -> None:
        """`trigger(availableNow=True)`: stop at what `upTo` allows now (in batches of
        `maxRowsPerTrigger`, if given); the next `latestOffset` fixes it."""
        self._available_now = True
        self._target = None

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.request.max_rows) if self.request.max_rows else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = self._offsets(start)
        self._touch(begin)
        self._check_retained(begin)
        dropped = self._dropped()
        bounds = self._bounds(begin, head=True if dropped else None)
        if self._available_now and self._target is None:
            self._target = bounds
        if self._target is not None:
            bounds = {v: min(b, self._target[v]) for v, b in bounds.items()}
        end = {v: max(begin[v], bounds[v]) for v in begin}
        if dropped and end == begin:
            raise StreamCollectionDroppedError(self.info.name, self.info.id, json.dumps(begin))
        if isinstance(limit, ReadMaxRows):
            end = self._capped(begin, end, limit.max_rows)
        return end

    def _capped(self, start: Offsets, end: Offsets, max_rows: int) -> Offsets:
        """`end`, lowered to about `max_rows` messages over the vchannels that have some, in
        whole files (at least one per vchannel)."""
        busy = [v for v in start if end[v] > start[v]]
        if not busy:
            return end
        share = max(1, math.ceil(max_rows / len(busy)))
        capped = dict(end)
        for v in busy:
            taken = 0
            for f in self._log(v).files_between(start[v], end[v]):
                taken += min(f.last_offset, end[v]) - max(f.first_offset - 1, start[v])
                if taken >= share:
                    capped[v] = min(f.last_offset, end[v])
                    break
        return capped

    def _touch(self, start: Offsets) -> None:
        now = time.time()
        if now - self._touched >= TOUCH_INTERVAL:
            touch_stream(self.store, self.request.stream_id, self.info, start, now)
            self._touched = now

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        begin, stop = self._offsets(start), self._offsets(end)
        parts: list[InputPartition] = []
        for v in self.info.vchannels:
            if stop[v] <= begin[v]:
                continue
            files = self._log(v).files_between(begin[v], stop[v])
            if not files or files[0].first_offset > begin[v] + 1:
                oldest = self._oldest(v)
                raise StreamOffsetRemovedError(v, begin[v] + 1, -1 if oldest is None else oldest)
            for group in _groups(files):
                first = max(begin[v], group[0].first_offset - 1)
                last = min(stop[v], group[-1].last_offset)
                slices = [LogSlice(f.key, f.first_offset, f.count) for f in group]
                parts.append(ChangesPartition(v, first, last, slices))
        return parts

    def commit(self, end: dict) -> None:
        """Spark's sink holds everything up to `end`: log retention may release it."""
        now = time.time()
        record_stream(self.store, self.request.stream_id, self.info, self._offsets(end), now)
        self._touched = now

    # --- tasks -----------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ChangesPartition)
        columns = ["partition_id", *(f.name for f in self.fields)]
        for f in partition.files:
            try:
                table = read_log_file(self.storage, f.key, self.info.schema, columns=columns)
            except CorruptLogError:
                if self.storage.exists(f.key):
                    raise
                oldest = self._oldest(partition.vchannel)
                raise StreamOffsetRemovedError(
                    partition.vchannel, f.first_offset, -1 if oldest is None else oldest
                ) from None
            rows = changes(table, partition.vchannel, partition.start, partition.end)
            yield from change_rows(rows, self.fields, self.request.read.vectors).to_batches(BATCH_ROWS)
            failpoint("stream_read")  # a file's changes handed to Spark, the task not done


def _groups(files: Sequence[WalFile]) -> list[list[WalFile]]:
    """Consecutive files of about PARTITION_MESSAGES messages each (one file at least)."""
    groups: list[list[WalFile]] = [[]]
    size = 0
    for f in files:
        if groups[-1] and size + f.count > PARTITION_MESSAGES:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += f.count
    return groups


def changes(table: pa.Table, vchannel: str, start: int, end: int) -> pa.Table:
    """The inserts and deletes of one log file at offsets in (start, end], in offset order,
    with the change columns.

    A file's changes are usually one run of rows (a batch's inserts or deletes, then its
    time tick): then they are a zero-copy slice, not a filter that copies every column."""
    offsets = table["offset"]
    keep = pc.and_(
        pc.and_(pc.greater(offsets, start), pc.less_equal(offsets, end)),
        pc.is_in(table["msg_type"], value_set=_CHANGES),
    )
    n = pc.sum(keep).as_py() or 0
    first = pc.index(keep, True).as_py() if n else 0
    if n and first + n <= table.num_rows and pc.all(keep.slice(first, n)).as_py():
        rows = table.slice(first, n)
    else:
        rows = table.filter(keep)
    rows = rows.rename_columns(
        ["op" if c == "msg_type" else "ts" if c == "timestamp" else c for c in rows.column_names]
    )
    return rows.append_column("vchannel", pa.repeat(pa.scalar(vchannel, pa.string()), n))


def change_rows(rows: pa.Table, fields: Sequence[FieldSchema], vectors: str) -> pa.Table:
    """Changes as the stream schema expects them: the change columns, then the fields."""
    columns = {name: rows[name] for name in CHANGE_COLUMNS}
    return pa.table({**columns, **{f.name: field_column(rows[f.name], f, vectors) for f in fields}})
