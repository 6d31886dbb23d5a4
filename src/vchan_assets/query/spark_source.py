"""`spark.read.format("vchan")`: a collection's live rows as a Spark DataFrame.

    register(spark)                      # spark_session(system) does it for its sessions
    df = (spark.read.format("vchan")
          .option("collection", "books")
          .option("partition", "_default")   # optional: partition names, comma-separated
          .option("segments", "7,9")         # optional: segment ids
          .option("fields", "pk,title")      # optional: the user fields to read
          .option("vectors", "array")        # array<float> (default) or binary (float32 LE)
          .option("task_mb", "128")          # binlog MB per Spark task; 0: one task per segment
          .option("as_of", "2026-11-25T20:30:00Z")  # optional: a time or hybrid timestamp; default now
          .option("pks", "42,43")            # optional: only these primary keys
          .option("pk_min", "100").option("pk_max", "199")  # optional: a pk range, both included
          .load())

The rows are what `Catalog.read_collection` returns (`query.asof`): at `as_of`, the
segments the query views of the collection's vchannels serve (`query.view`) and the log
after each checkpoint that no segment holds yet, with Milvus' delete rule applied per
partition (a delete removes the rows of its pk in its partition that are older than it),
plus `segment_id` and `partition_id`. With `segments`, only those segments (no log).

`pks`, `pk_min` and `pk_max` are pushed down (`query.prune`): a segment whose stats logs
(pk range, bloom filter) rule the pks out is not read, and the rows of the others and
of the log are filtered exactly. They are options, not `df.filter(...)` handed to
`DataSourceReader.pushFilters`: Spark 4 keeps the read plan a pushdown made for a
DataFrame and reuses it for the DataFrame's later queries that push nothing (after
`df.filter(df.pk == 300).count()`, `df.count()` counted 1 row), so a pushed filter would
leak into other queries.

Layout: planning (in a Spark Python worker) reads the segment meta from etcd once, makes
the query views, and groups the segments they serve into Spark partitions of about `task_mb` of binlogs each, at least
two per Spark core (`VCHAN_SPARK_PARTITIONS`) while there are segments: a Python task
costs a few hundred milliseconds however little it reads, so small segments share one.
Each task reads only its segments' binlogs (the vector column groups only when a vector
field is asked for) and, once, the delta logs of their partitions, then yields Arrow
batches segment by segment. Each vchannel's log tail is one more task; the tail's deletes
(the pk and partition columns of the log only) are read at planning and travel with every
task. Nothing goes through Python rows.

`spark.readStream.format("vchan")` is the same source's change stream (the inserts and
deletes of the log, by vchannel offsets): `query.stream_source`. Spark asks a Python
source for one schema whether it reads or streams, so the stream's `streamId` option
(every stream has one) selects the change schema.

Connection: options named like the environment variables (`VCHAN_ETCD_ENDPOINTS`,
`VCHAN_STORAGE_URI`, ...; any case) override the worker's environment;
`Catalog.spark_collection` passes its own. Spark redacts option values
whose names contain "password" or "secret" from plans and logs.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import (
    LongType,
    StructField,
    StructType,
)

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.read_pins import ReadPinLostError, pin_read
from vchan_assets.model import CollectionInfo, FieldSchema, SegmentInfo
from vchan_assets.query.asof import Tail, at_or_before, resolve_as_of, tail_of, views_at
from vchan_assets.query.prune import EVERYTHING, PkFilter, prune
from vchan_assets.query.source_options import (
    ReadOptionError,
    ReadRequest,
    field_column,
    selected_fields,
    settings_from_options,
    spark_type,
)
from vchan_assets.query.stream_source import VchanStreamReader, stream_schema
from vchan_assets.query.view import QueryView, delete_paths
from vchan_assets.spark.session import get_spark
from vchan_assets.stack import Stack
from vchan_assets.storage import Storage, StorageError
from vchan_assets.storage.rows import apply_deletes_to, concat_deletes, read_deletes, segment_rows, unexpired
from vchan_assets.system import System

SOURCE_NAME = "vchan"
META_COLUMNS = ("row_id", "timestamp")
LOCATION_COLUMNS = ("segment_id", "partition_id")
BATCH_ROWS = 65_536
TASKS_PER_CORE = 2


def collection_schema(info: CollectionInfo, request: ReadRequest) -> StructType:
    fields = [StructField(name, LongType()) for name in META_COLUMNS]
    fields += [StructField(f.name, spark_type(f, request.vectors)) for f in selected_fields(info, request)]
    fields += [StructField(name, LongType()) for name in LOCATION_COLUMNS]
    return StructType(fields)


class SegmentsPartition(InputPartition):
    """One Spark partition: some segments and the delta logs of their partitions."""

    def __init__(self, segments: Sequence[SegmentInfo], delete_paths: Mapping[int, Sequence[str]]) -> None:
        super().__init__(tuple(s.id for s in segments))
        self.segments = tuple(segments)
        self.delete_paths = {partition: tuple(paths) for partition, paths in delete_paths.items()}


class TailPartition(InputPartition):
    """One Spark partition: a vchannel's log after its checkpoint, the inserts no segment
    holds yet."""

    def __init__(self, tail: Tail) -> None:
        super().__init__(tail.vchannel)
        self.tail = tail


def plan_partitions(
    info: CollectionInfo,
    views: Sequence[QueryView],
    request: ReadRequest,
    min_tasks: int = 1,
    with_vectors: bool = True,
    kept: Collection[int] | None = None,
) -> list[SegmentsPartition]:
    """The segments the query `views` serve that are asked for (and `kept` by a pushdown,
    if given), grouped into tasks of about
    `request.task_mb` of binlogs (counting the vector groups only `with_vectors`), at
    least `min_tasks` of them while there are segments; `task_mb` 0 makes one task per
    segment."""
    partition_ids = _partition_ids(info, request.partitions)
    chosen = [
        s
        for view in views
        for s in view.readable
        if (not partition_ids or s.partition_id in partition_ids)
        and (not request.segments or s.id in request.segments)
    ]
    missing = sorted(set(request.segments) - {s.id for s in chosen})
    if missing:
        raise ReadOptionError(
            f"collection {info.name!r} has no readable segment {missing} (in the partitions asked "
            f"for, served by the query view: not L0, not Dropped, not Importing, with binlogs)"
        )
    if kept is not None:
        chosen = [s for s in chosen if s.id in kept]
    sizes = {s.id: _read_bytes(s, with_vectors) for s in chosen}
    task_bytes = request.task_mb * 2**20
    wanted = math.ceil(sum(sizes.values()) / task_bytes) if task_bytes else len(chosen)
    tasks = _balance(chosen, sizes, min(len(chosen), max(min_tasks, wanted)))
    return [
        SegmentsPartition(task, {p: delete_paths(views, p) for p in sorted({s.partition_id for s in task})})
        for task in tasks
    ]


def _read_bytes(seg: SegmentInfo, with_vectors: bool) -> int:
    """Binlog bytes a read of `seg` fetches: the scalar group (the lowest), and the vector
    groups `with_vectors` (as `segment_rows` reads them)."""
    groups = sorted(seg.binlogs, key=lambda g: g.group)
    return sum(b.size_bytes for g in (groups if with_vectors else groups[:1]) for b in g.logs)


def _balance(segments: Sequence[SegmentInfo], sizes: Mapping[int, int], n: int) -> list[list[SegmentInfo]]:
    """`n` groups of about equal bytes: largest segment first into the lightest group."""
    groups: list[list[SegmentInfo]] = [[] for _ in range(n)]
    loads = [0] * n
    for seg in sorted(segments, key=lambda s: (-sizes[s.id], s.id)):
        lightest = loads.index(min(loads))
        groups[lightest].append(seg)
        loads[lightest] += sizes[seg.id]
    return sorted((sorted(g, key=lambda s: s.id) for g in groups if g), key=lambda g: g[0].id)


def _partition_ids(info: CollectionInfo, names: Sequence[str]) -> set[int]:
    by_name = dict(zip(info.partition_names, info.partitions, strict=False))
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ReadOptionError(
            f"collection {info.name!r} has no partition {unknown}; partitions: {sorted(by_name)}"
        )
    return {by_name[n] for n in names}


def read_segment(
    storage: Storage,
    seg: SegmentInfo,
    deletes: pa.Table,
    fields: Sequence[FieldSchema],
    pk: str,
    vectors: str,
    ts: int | None = None,
    pks: PkFilter = EVERYTHING.pk,
    expired_before: int = 0,
) -> pa.Table:
    """The live rows of one segment (`deletes`: its partition's; rows after `ts` and rows
    a TTL expired (inserted before `expired_before`) left out; only the pks `pks` keeps) as
    the Spark schema expects them."""
    wants_vectors = any(f.is_vector for f in fields)
    table = segment_rows(storage, seg, with_vectors=wants_vectors)
    if ts is not None:
        table = at_or_before(table, ts)
    table = unexpired(table, expired_before)
    table = pks.rows(table, pk, seg.is_sorted)
    table = apply_deletes_to(table, deletes, pk)
    missing = [f.name for f in fields if f.name not in table.column_names]
    if missing:
        raise SegmentColumnError(seg, missing[0], table.column_names)
    n = table.num_rows
    table = table.append_column("segment_id", pa.array(np.full(n, seg.id, np.int64)))
    table = table.append_column("partition_id", pa.array(np.full(n, seg.partition_id, np.int64)))
    return spark_rows(table, fields, vectors)


def spark_rows(table: pa.Table, fields: Sequence[FieldSchema], vectors: str) -> pa.Table:
    """Rows (row_id, timestamp, the fields, segment_id, partition_id) as the Spark schema
    expects them: the fields asked for, vectors as lists or plain binary."""
    columns: dict[str, pa.Array | pa.ChunkedArray] = {name: table[name] for name in META_COLUMNS}
    for f in fields:
        columns[f.name] = field_column(table[f.name], f, vectors)
    for name in LOCATION_COLUMNS:
        columns[name] = table[name]
    return pa.table(columns)


class SegmentColumnError(LookupError):
    """A segment's binlogs lack a field of the collection schema (a schema change)."""

    def __init__(self, seg: SegmentInfo, field: str, found: Sequence[str]) -> None:
        paths = [b.path for g in seg.binlogs for b in g.logs][:3]
        super().__init__(
            f"segment {seg.id} of collection {seg.collection_id}: its binlogs ({', '.join(paths)}) "
            f"have no column {field!r}; found {list(found)}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (LookupError, (str(self),))


@contextlib.contextmanager
def _meta(settings: Settings) -> Iterator[Stack]:
    """etcd and storage for planning, without the pandas-based catalog (planning runs in
    fresh Python workers: every import counts). A worker uses the running etcd; it
    never starts one."""
    stack = Stack.open(settings, start_etcd=False)
    try:
        yield stack
    finally:
        stack.close()


class VchanReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.request = ReadRequest.from_options(options)
        settings = settings_from_options(options)
        self.storage = Storage.from_settings(settings)
        self.settings = settings
        with _meta(settings) as stack:
            info = CollectionRegistry(stack.store).get_by_name(self.request.collection)
            self.ts = resolve_as_of(stack.store, settings, self.request.as_of or None)
            # Pinned before segment meta is listed; the pin expires with its lease
            # (VCHAN_READ_PIN_TTL): nothing tells the planner when the Spark job ends.
            self.pin = pin_read(stack.store, settings, info.id, self.ts)
            segments, views = views_at(stack.store, info, self.ts)
        self.info = info
        asked = set(schema.fieldNames())
        self.fields = [f for f in selected_fields(info, self.request) if f.name in asked]
        self.views, self.segments = views, segments
        self.partition_ids = _partition_ids(info, self.request.partitions)
        self.delete_paths = {p: tuple(delete_paths(views, p)) for p in info.partitions}
        self.pk = info.schema.primary.name
        self.pushdown = self.request.pushdown(info)
        self.tail_deletes: dict[int, list[pa.Table]] = {}
        # Planned here, not in partitions(): Spark pickles `read` with the reader as it is
        # before partitions() runs, and every task needs the tail's deletes.
        self.parts = self._plan()

    def partitions(self) -> Sequence[InputPartition]:
        return self.parts

    def _plan(self) -> list[InputPartition]:
        """The Spark partitions: segments the views serve and the pushdown keeps, in tasks
        of about `task_mb`, then a task per vchannel whose log tail holds inserts."""
        with_vectors = any(f.is_vector for f in self.fields)
        served = [s for v in self.views for s in v.readable]
        kept = {s.id for s in prune(self.storage, served, self.pushdown)}
        parts: list[InputPartition] = list(
            plan_partitions(
                self.info,
                self.views,
                self.request,
                min_tasks=TASKS_PER_CORE * self.settings.spark_partitions,
                with_vectors=with_vectors,
                kept=kept,
            )
        )
        if not self.request.segments:  # a read of chosen segments reads no log
            for view in self.views:
                tail = tail_of(view, self.segments, self.ts)
                plan = tail.plan(self.storage, self.info)
                for part, found in plan.deletes.items():
                    self.tail_deletes.setdefault(part, []).append(found)
                if plan.inserts:
                    parts.append(TailPartition(tail))
        return parts

    def _deletes(self, partition_id: int) -> pa.Table:
        persisted = read_deletes(self.storage, self.delete_paths.get(partition_id, ()))
        found = concat_deletes([persisted, *self.tail_deletes.get(partition_id, [])])
        return at_or_before(found, self.ts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        try:
            yield from self._read(partition)
        except StorageError as exc:
            with _meta(self.settings) as stack:
                alive = self.pin.alive(stack.store)
            if alive:
                raise
            raise ReadPinLostError(self.pin.pin_id, self.pin.ttl, exc.path) from exc

    def _read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, TailPartition):
            yield from self._read_tail(partition)
            return
        assert isinstance(partition, SegmentsPartition)
        deletes = {p: self._deletes(p) for p in partition.delete_paths}
        for seg in partition.segments:  # one segment's rows in memory at a time
            table = read_segment(
                self.storage,
                seg,
                deletes[seg.partition_id],
                self.fields,
                self.pk,
                self.request.vectors,
                self.ts,
                self.pushdown.pk,
                self.info.expired_before(self.ts),
            )
            yield from table.to_batches(max_chunksize=BATCH_ROWS)

    def _read_tail(self, partition: TailPartition) -> Iterator[pa.RecordBatch]:
        with_vectors = any(f.is_vector for f in self.fields)
        tail = partition.tail.read(self.storage, self.info, with_vectors)
        for part in pc.unique(tail.rows["partition_id"]).to_pylist():
            if (self.partition_ids and part not in self.partition_ids) or not self.pushdown.keeps_partition(
                part
            ):
                continue
            rows = tail.rows.filter(pc.equal(tail.rows["partition_id"], part))
            rows = unexpired(self.pushdown.pk.rows(rows, self.pk), self.info.expired_before(self.ts))
            rows = apply_deletes_to(rows, self._deletes(part), self.pk)
            yield from spark_rows(rows, self.fields, self.request.vectors).to_batches(
                max_chunksize=BATCH_ROWS
            )


class VchanDataSource(DataSource):
    """`format("vchan")`: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        """The rows of a batch read, or the changes of a stream: Spark asks both the same
        way, so a `streamId` option (which every stream has) tells them apart."""
        request = ReadRequest.from_options(self.options)
        with _meta(settings_from_options(self.options)) as stack:
            info = CollectionRegistry(stack.store).get_by_name(request.collection)
        if _is_stream(self.options):
            return stream_schema(info, request)
        return collection_schema(info, request)

    def reader(self, schema: StructType) -> DataSourceReader:
        if _is_stream(self.options):
            raise ReadOptionError('option streamId is for spark.readStream.format("vchan"), not spark.read')
        return VchanReader(self.options, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return VchanStreamReader(self.options)


def _is_stream(options: Mapping[str, str]) -> bool:
    return any(k.lower() == "streamid" for k in options)


_registered: weakref.WeakSet[Any] = weakref.WeakSet()


def register(spark: Any) -> None:
    """Make `format("vchan")` known to this session (local or Spark Connect), once."""
    if spark not in _registered:
        spark.dataSource.register(VchanDataSource)
        _registered.add(spark)


def spark_session(system: System) -> Any:
    """The system's Spark session (the one it was given, else the process's own,
    `spark.session.get_spark`), with `format("vchan")` registered on it."""
    spark = system.spark or get_spark(system.settings)
    register(spark)
    return spark


def read_options(settings: Settings, endpoints: Sequence[str]) -> dict[str, str]:
    """Options that point a read at the same etcd and storage as `settings`."""
    return {**settings.to_env(), "VCHAN_ETCD_ENDPOINTS": ",".join(endpoints)}
