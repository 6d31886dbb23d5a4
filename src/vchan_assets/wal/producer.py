"""The producer: Milvus' proxy role, writing inserts, deletes, time ticks and DDL to the log.

Per channel, holding the channel's append lock in etcd (`wal.appender`), a batch is:
timestamps above the channel's last, segment IDs from the open segments of the channel
head (inserts), the rows, then a time tick, all in ONE log file, so the tick is the
batch's last message (docs/architecture.md, "The log"). The inserted rows' columns go to
the batch's data file before the lock is taken (log format 2, `wal.format`), so the lock
covers only the small log file of system columns. Rows go to vchannels by
primary key (`pk % K` for an int64 pk, the key's hash `% K` for a VarChar pk:
`fields.vchannel_index`; Milvus hashes both).

Any number of producer processes may write one collection (docs/multi-writer.md):
offsets stay dense, timestamps increase with the offset, and a segment sealed at
`seal_ts` (by a policy, the coordinator or any client's flush, all under the same
lock) only holds rows with smaller timestamps, every one of them in the log before any
time tick at or above `seal_ts`.

Inserts and deletes meet back-pressure first (`wal.backpressure`): a channel whose
checkpoint lags too far slows them, then refuses them with `WriteLagExceededError`.

Every call retries while etcd or storage is unavailable, up to
`VCHAN_CLIENT_RETRY_TIMEOUT`, then raises the last error; a retried append never
writes its batch twice. Collection meta is cached here and refreshed on a miss.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets import fields
from vchan_assets.datacoord.collections import (
    DEFAULT_KEY_PARTITIONS,
    DEFAULT_PARTITION,
    CollectionRegistry,
    PartitionNotFoundError,
)
from vchan_assets.datacoord.segment_manager import SealedSegment, SegmentManager
from vchan_assets.meta.allocator import IdAllocator, TimestampOracle
from vchan_assets.meta.channel_head import HeldChannel
from vchan_assets.meta.errors import MetaUnavailableError
from vchan_assets.meta.retry import retry_transient
from vchan_assets.model import CollectionInfo, CollectionSchema, DataType, FieldSchema, MsgPosition
from vchan_assets.storage import StorageError
from vchan_assets.system import System
from vchan_assets.wal.appender import Built, ChannelAppender, Prepared, Timing
from vchan_assets.wal.backpressure import WriteLimiter
from vchan_assets.wal.format import SYSTEM_SCHEMA, MsgType, log_schema
from vchan_assets.wal.reader import WalReader
from vchan_assets.wal.writer import WalWriter

T = TypeVar("T")


@dataclass(frozen=True)
class ChannelAppend:
    """What one batch appended to one channel."""

    vchannel: str
    first_offset: int
    last_offset: int  # the batch's closing time tick
    timestamp: int  # of that time tick
    rows: int  # messages before the tick
    segments: tuple[tuple[int, int], ...] = ()  # (segment_id, rows) of inserts

    def then(self, later: ChannelAppend) -> ChannelAppend:
        """This append and a later one of the same channel, as one."""
        return replace(
            later,
            first_offset=self.first_offset,
            rows=self.rows + later.rows,
            segments=self.segments + later.segments,
        )

    @property
    def position(self) -> MsgPosition:
        """The channel position after this batch (its time tick)."""
        return MsgPosition(self.vchannel, self.last_offset, self.timestamp)


class Producer:
    """Writes a collection's messages to its vchannels (the proxy role)."""

    def __init__(
        self,
        system: System,
        *,
        ids: IdAllocator | None = None,
        tso: TimestampOracle | None = None,
        segments: SegmentManager | None = None,
        catalog: CollectionRegistry | None = None,
        seal_after_insert: bool = True,
    ) -> None:
        if segments is not None and tso is not None and tso is not segments.tso:
            raise ValueError("the producer must share the segment manager's timestamp oracle")
        store, settings = system.store, system.settings
        self.store, self.storage, self.settings = store, system.storage, settings
        self.ids = ids or (segments.ids if segments else IdAllocator(store))
        self.tso = segments.tso if segments else (tso or TimestampOracle(store))
        self.segments = segments or SegmentManager(store, settings, self.ids, self.tso)
        self.catalog = catalog or CollectionRegistry(store, self.ids)
        self.seal_after_insert = seal_after_insert
        self.last_sealed: list[SealedSegment] = []
        self._collections: dict[str, CollectionInfo] = {}
        self._writers: dict[str, WalWriter] = {}
        self._appenders: dict[str, ChannelAppender] = {}
        self.limiter = WriteLimiter(store, system.storage, settings)

    def close(self) -> None:
        """Give up this producer's append locks at once (else their lease expires)."""
        self.segments.heads.close()

    def lock_timings(self) -> dict[str, Timing]:
        """Append-lock metrics summed over this producer's channels: "acquiring" (the acquire
        round trip and any wait) and "held" (the critical section), count and seconds."""
        out = {"acquiring": Timing(), "held": Timing()}
        for appender in self._appenders.values():
            for name, timing in (("acquiring", appender.acquiring), ("held", appender.held)):
                out[name] = Timing(out[name].count + timing.count, out[name].seconds + timing.seconds)
        return out

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        return retry_transient(
            what, call, self.settings.client_retry_timeout, (MetaUnavailableError, StorageError)
        )

    # --- collections ---------------------------------------------------------------------

    def collection(self, name: str, refresh: bool = False) -> CollectionInfo:
        """The collection's meta (cached); a collection whose channels lack their
        create_collection message (a crash during create) is completed here."""
        info = None if refresh else self._collections.get(name)
        if info is None:
            info = self._retry(f"read collection {name}", lambda: self.catalog.get_by_name(name))
            if len(info.start_positions) < len(info.vchannels):
                info = self._start_channels(info)
            self._collections[name] = info
        return info

    def create_collection(
        self,
        name: str,
        schema: CollectionSchema,
        partitions: Sequence[str] = (),
        num_channels: int = 2,
        ttl_seconds: int = 0,
        num_partitions: int = DEFAULT_KEY_PARTITIONS,
    ) -> CollectionInfo:
        """Create the collection's meta, then write a create_collection message at offset 0
        of every vchannel and record those as the start positions. Rows expire after
        `ttl_seconds` (0: never; `set_ttl` changes it); a schema with a partition key gets
        `num_partitions` hidden partitions."""
        info = self.catalog.create(
            name, schema, [DEFAULT_PARTITION, *partitions], num_channels, ttl_seconds, num_partitions
        )
        info = self._start_channels(info)
        self._collections[name] = info
        return info

    def _start_channels(self, info: CollectionInfo) -> CollectionInfo:
        started = {p.channel for p in info.start_positions}
        payload = info.to_dict()
        payload.pop("start_positions")
        positions = []
        for vchannel in info.vchannels:
            if vchannel in started:
                continue
            done = self._append_control(
                info, vchannel, MsgType.CREATE_COLLECTION, payload, only_if_empty=True
            )
            if done is not None:
                positions.append(MsgPosition(vchannel, done.first_offset, done.timestamp - 1))
            else:  # written before a crash, or by another client: the first message is the create
                first = WalReader(self.storage, vchannel, info).files()[0]
                positions.append(MsgPosition(vchannel, first.first_offset, first.first_timestamp or 0))
        return self.catalog.set_start_positions(info.id, positions) if positions else info

    def drop_collection(self, collection_name: str) -> CollectionInfo:
        """Mark the collection dropped, its segments Dropped, and write drop_collection
        on every channel."""
        info = self.collection(collection_name, refresh=True)
        with self._all_channels(info):
            dropped = self.catalog.drop(collection_name)
            self.segments.drop_collection(info.id)
            payload = {"collection_id": info.id, "collection_name": info.name}
            for vchannel in info.vchannels:
                self._append_control(info, vchannel, MsgType.DROP_COLLECTION, payload)
        self._collections.pop(collection_name, None)
        for vchannel in info.vchannels:
            self._writers.pop(vchannel, None)
            self._appenders.pop(vchannel, None)
        return dropped

    def set_ttl(self, collection_name: str, ttl_seconds: int) -> CollectionInfo:
        """Change the collection's `collection.ttl.seconds` (0: rows never expire)."""
        info = self.catalog.set_ttl(collection_name, ttl_seconds)
        self._collections[collection_name] = info
        return info

    def create_partition(self, collection_name: str, partition: str) -> int:
        """Add a partition and write create_partition on every channel; returns its id."""
        return self._change_partition(collection_name, partition, MsgType.CREATE_PARTITION)

    def drop_partition(self, collection_name: str, partition: str) -> int:
        """Remove a partition, mark its segments Dropped, write drop_partition everywhere."""
        return self._change_partition(collection_name, partition, MsgType.DROP_PARTITION)

    def _change_partition(self, collection_name: str, partition: str, kind: MsgType) -> int:
        """Create or drop a partition in the catalog while holding every channel's append
        lock, then announce it on every channel; returns its id."""
        info = self.collection(collection_name, refresh=True)
        dropping = kind is MsgType.DROP_PARTITION
        change = self.catalog.drop_partition if dropping else self.catalog.create_partition
        with self._all_channels(info):
            info, partition_id = change(collection_name, partition)
            self._collections[collection_name] = info
            if dropping:
                self.segments.drop_partition(info.id, partition_id)
            self._announce_partition(info, kind, partition_id, partition)
        return partition_id

    def _announce_partition(
        self, info: CollectionInfo, kind: MsgType, partition_id: int, partition: str
    ) -> None:
        """A partition DDL message (create or drop) on every channel of the collection."""
        payload = {"collection_id": info.id, "partition_id": partition_id, "partition_name": partition}
        for vchannel in info.vchannels:
            self._append_control(info, vchannel, kind, payload, partition_id)

    # --- data ----------------------------------------------------------------------------

    def insert(
        self,
        collection_name: str,
        rows: pa.Table | pa.RecordBatch | Mapping[str, Any],
        partition: str = DEFAULT_PARTITION,
    ) -> dict[str, ChannelAppend]:
        """Insert rows (every field of the schema; vectors as float arrays (n, dim), lists,
        fixed_size_list, or fixed_size_binary as the field stores them: dim * 4 bytes, dim * 2
        for float16 and bfloat16 vectors; binary vectors as an (n, dim / 8) uint8 matrix of
        packed bits, an (n, dim) bool matrix, `bytes` per row or the stored
        fixed_size_binary(dim / 8); sparse vectors as `fields.sparse_array` takes them:
        {index: value} dicts, (indices, values) pairs, a scipy.sparse matrix). Returns per channel what
        was appended; each channel's batch ends with a time tick. In a collection with a
        partition key, each row goes to the hidden partition its key's hash picks
        (`partition` must be left at its default)."""
        info = self.collection(collection_name)
        key = info.schema.partition_key
        if key is not None and partition != DEFAULT_PARTITION:
            raise ValueError(
                f"collection {info.name!r} has a partition key ({key.name!r}): its rows choose their partitions"
            )
        table = to_insert_table(info.schema, rows)
        self.last_sealed = []
        if key is None:
            return self._insert_table(info, self._partition_id(info, partition), table)
        index = fields.vchannel_index(table.column(key.name), len(info.partitions))
        appended: dict[str, ChannelAppend] = {}
        for i in np.unique(index).tolist():
            chosen = table.filter(pa.array(index == i))
            for v, done in self._insert_table(info, info.partitions[i], chosen).items():
                appended[v] = done if v not in appended else appended[v].then(done)
        return appended

    def _insert_table(
        self, info: CollectionInfo, partition_id: int, table: pa.Table
    ) -> dict[str, ChannelAppend]:
        parts = list(self._route(info, table, table.column(info.schema.primary.name)))
        self.limiter.admit(info, [v for v, _ in parts])  # back-pressure: may sleep or refuse
        for v, part in parts:
            self.limiter.wrote(v, part.nbytes)
        # Every channel's data file first, no lock held: the locks then cover small files only.
        prepared = [(v, part.num_rows, self._appender(info, v).prepare(part)) for v, part in parts]
        return self._each_channel(
            {v: functools.partial(self._append_inserts, info, v, partition_id, n, p) for v, n, p in prepared}
        )

    def delete(
        self,
        collection_name: str,
        pks: Sequence[int] | Sequence[str] | np.ndarray | pa.Array,
        partition: str | None = None,
    ) -> dict[str, ChannelAppend]:
        """Delete by primary key, in one partition or (None, as Milvus) in every
        partition: one delete message per (pk, partition), routed like the inserts."""
        info = self.collection(collection_name)
        partition_ids = list(info.partitions) if partition is None else [self._partition_id(info, partition)]
        keys = fields.pk_values(info.schema.primary, pks)
        if len(keys) == 0:
            raise ValueError("no primary keys to delete")
        parts = list(self._route(info, pa.table({"pk": keys}), keys))
        self.limiter.admit(info, [v for v, _ in parts])
        for v, part in parts:
            self.limiter.wrote(v, part.nbytes * len(partition_ids))
        return self._each_channel(
            {
                v: functools.partial(self._append_deletes, info, v, partition_ids, part.column("pk"))
                for v, part in parts
            }
        )

    def time_tick(self, collection_name: str, at_least: int = 0) -> dict[str, MsgPosition]:
        """Append a time tick (at or above `at_least`) to every channel: lets checkpoints
        pass a flush timestamp."""
        info = self.collection(collection_name)
        out = {}
        for vchannel in info.vchannels:

            def build(held: HeldChannel) -> Built[int]:
                ts = self.segments.next_ts(held.head, 1, at_least)
                table = self._control_table(info, MsgType.TIME_TICK, ts)
                return Built(table, replace(held.head, last_ts=ts), ts)

            done = self._appender(info, vchannel).append(build)
            assert done is not None
            out[vchannel] = MsgPosition(vchannel, done.first_offset, done.result)
        return out

    def flush(self, collection_name: str) -> int:
        """Seal every growing segment of the collection and tick every channel at or
        above the flush timestamp; returns it, to poll `flush_state` with. Any client may
        flush while others insert: the seals hold the same locks as their appends."""
        info = self.collection(collection_name)
        flush_ts = self._retry(f"flush {info.name}", lambda: self.segments.flush(info.id))
        self.time_tick(collection_name, at_least=flush_ts + 1)
        return flush_ts

    def flush_state(self, collection_name: str, flush_ts: int) -> bool:
        info = self.collection(collection_name)
        return self._retry("flush state", lambda: self.segments.flush_state(info.id, flush_ts))

    def wait_flushed(
        self, collection_name: str, flush_ts: int, timeout: float = 60.0, poll: float = 0.2
    ) -> bool:
        """Poll flush_state until true or `timeout`; returns the last state."""
        deadline = time.monotonic() + timeout
        while not self.flush_state(collection_name, flush_ts):
            if time.monotonic() > deadline:
                return False
            time.sleep(poll)
        return True

    # --- internals -----------------------------------------------------------------------

    def _writer(self, info: CollectionInfo, vchannel: str) -> WalWriter:
        writer = self._writers.get(vchannel)
        if writer is None or writer.collection.id != info.id:
            writer = self._writers[vchannel] = WalWriter(self.storage, vchannel, info)
        return writer

    def _appender(self, info: CollectionInfo, vchannel: str) -> ChannelAppender:
        writer = self._writer(info, vchannel)
        appender = self._appenders.get(vchannel)
        if appender is None or appender.writer is not writer:
            appender = self._appenders[vchannel] = ChannelAppender(
                self.segments.heads, writer, self.settings.client_retry_timeout, writer.lock
            )
        return appender

    @contextlib.contextmanager
    def _all_channels(self, info: CollectionInfo) -> Iterator[None]:
        """Hold every channel lock of the collection (in name order: no deadlock), so a
        DDL message is not interleaved with a batch prepared under the old meta."""
        with contextlib.ExitStack() as stack:
            for vchannel in sorted(info.vchannels):
                stack.enter_context(self._writer(info, vchannel).lock)
            yield

    @staticmethod
    def _each_channel(
        appends: Mapping[str, Callable[[bool], ChannelAppend | None]],
    ) -> dict[str, ChannelAppend]:
        """One append per channel, in the order the channels' locks come free: a pass that
        skips busy channels, then a wait on the first one left, and again. Producers that
        all start with channel 0 fall into step on different channels instead of queueing."""
        out: dict[str, ChannelAppend] = {}
        pending = list(appends)
        while pending:
            before = len(pending)
            for vchannel in list(pending):
                done = appends[vchannel](len(pending) == 1)  # the last one waits
                if done is not None:
                    out[vchannel] = done
                    pending.remove(vchannel)
            if len(pending) == before:  # every lock was busy: wait for the first
                vchannel = pending.pop(0)
                done = appends[vchannel](True)
                assert done is not None
                out[vchannel] = done
        return {v: out[v] for v in appends}

    def _partition_id(self, info: CollectionInfo, partition: str) -> int:
        if partition not in info.partition_names:
            info = self.collection(info.name, refresh=True)  # created by someone else?
            if partition not in info.partition_names:
                raise PartitionNotFoundError(info.name, partition)
        return info.partition_id(partition)

    def _route(
        self, info: CollectionInfo, table: pa.Table, pks: pa.ChunkedArray | pa.Array
    ) -> Iterator[tuple[str, pa.Table]]:
        """(vchannel, rows) by `fields.vchannel_index` (pk % K for int64 pks, a hash for
        VarChar pks); one copy of the rows at most (a stable sort)."""
        k = len(info.vchannels)
        if k == 1:
            yield info.vchannels[0], table
            return
        channel = fields.vchannel_index(pks, k)
        order = np.argsort(channel, kind="stable")
        counts = np.bincount(channel, minlength=k)
        ordered = table.take(pa.array(order))
        start = 0
        for vchannel, count in zip(info.vchannels, counts.tolist(), strict=True):
            if count:
                yield vchannel, ordered.slice(start, count)
            start += count

    def _append_inserts(
        self,
        info: CollectionInfo,
        vchannel: str,
        partition_id: int,
        n: int,
        prepared: Prepared,
        block: bool = True,
    ) -> ChannelAppend | None:
        """Append `n` inserts whose data file is `prepared`, then a time tick."""

        def build(held: HeldChannel) -> Built[tuple[int, tuple[tuple[int, int], ...]]]:
            now = time.time()
            self.segments.open_for(held, info.id, partition_id, n, now)
            tick_ts = self.segments.next_ts(held.head, 2)
            head, assigned, full = self.segments.allocate(
                held.head, info.id, partition_id, n, tick_ts - 1, now, self.seal_after_insert
            )
            segment_ids = np.repeat(
                np.array([s for s, _ in assigned], dtype=np.int64), [c for _, c in assigned]
            )
            system = {
                "msg_type": pa.repeat(pa.scalar(MsgType.INSERT.value), n),
                "timestamp": pa.array(np.full(n, tick_ts - 1, dtype=np.int64)),
                "segment_id": pa.array(segment_ids),
                "partition_id": pa.array(np.full(n, partition_id, dtype=np.int64)),
                "payload": pa.nulls(n, pa.string()),
            }
            batch = pa.Table.from_arrays(list(system.values()), schema=_SYSTEM_BATCH_SCHEMA)
            tick = self._control_table(info, MsgType.TIME_TICK, tick_ts).select(_SYSTEM_BATCH_SCHEMA.names)
            table = pa.concat_tables([batch, tick])

            def seal_full() -> None:  # they left the head with this batch: seal them at its tick
                sealed = self._retry("seal", lambda: self.segments.seal_left(full, tick_ts))
                self.last_sealed += sealed

            after = seal_full if full else None
            return Built(table, replace(head, last_ts=tick_ts), (tick_ts, tuple(assigned)), after)

        done = self._appender(info, vchannel).append(build, block=block, prepared=prepared)
        if done is None:
            return None  # the lock was busy and `block` was false: nothing was done
        tick_ts, assigned = done.result
        return ChannelAppend(vchannel, done.first_offset, done.last_offset, tick_ts, n, assigned)

    def _append_deletes(
        self,
        info: CollectionInfo,
        vchannel: str,
        partition_ids: list[int],
        pks: pa.ChunkedArray,
        block: bool = True,
    ) -> ChannelAppend | None:
        keys = pa.concat_arrays([pks.combine_chunks()] * len(partition_ids))
        parts = np.repeat(np.array(partition_ids, dtype=np.int64), len(pks))
        n = len(keys)

        def build(held: HeldChannel) -> Built[int]:
            tick_ts = self.segments.next_ts(held.head, 2)
            schema = _batch_schema(info)
            values = {
                "msg_type": pa.repeat(pa.scalar(MsgType.DELETE.value), n),
                "timestamp": pa.array(np.full(n, tick_ts - 1, dtype=np.int64)),
                "partition_id": pa.array(parts),
                info.schema.primary.name: keys,
            }
            batch = pa.Table.from_arrays(
                [values.get(f.name, pa.nulls(n, f.type)) for f in schema], schema=schema
            )
            table = pa.concat_tables([batch, self._control_table(info, MsgType.TIME_TICK, tick_ts)])
            return Built(table, replace(held.head, last_ts=tick_ts), tick_ts)

        done = self._appender(info, vchannel).append(build, block=block)
        if done is None:
            return None
        return ChannelAppend(vchannel, done.first_offset, done.last_offset, done.result, n)

    def _append_control(
        self,
        info: CollectionInfo,
        vchannel: str,
        kind: MsgType,
        payload: Mapping[str, Any],
        partition_id: int | None = None,
        only_if_empty: bool = False,
    ) -> ChannelAppend | None:
        """A DDL message followed by a time tick, as one batch (None: `only_if_empty`
        and the channel has messages)."""

        def build(held: HeldChannel) -> Built[int]:
            tick_ts = self.segments.next_ts(held.head, 2)
            message = self._control_table(info, kind, tick_ts - 1, payload, partition_id)
            tick = self._control_table(info, MsgType.TIME_TICK, tick_ts)
            return Built(pa.concat_tables([message, tick]), replace(held.head, last_ts=tick_ts), tick_ts)

        done = self._appender(info, vchannel).append(build, only_if_empty)
        if done is None:
            return None
        return ChannelAppend(vchannel, done.first_offset, done.last_offset, done.result, 1)

    @staticmethod
    def _control_table(
        info: CollectionInfo,
        kind: MsgType,
        ts: int,
        payload: Mapping[str, Any] | None = None,
        partition_id: int | None = None,
    ) -> pa.Table:
        """One message without data columns, in the log's column order (nulls elsewhere)."""
        schema = _batch_schema(info)
        values: dict[str, Any] = {
            "msg_type": kind.value,
            "timestamp": ts,
            "partition_id": partition_id,
            "payload": json.dumps(payload, separators=(",", ":")) if payload is not None else None,
        }
        return pa.Table.from_arrays(
            [pa.array([values.get(f.name)], type=f.type) for f in schema], schema=schema
        )


_SYSTEM_BATCH_SCHEMA = SYSTEM_SCHEMA.remove(0)  # what an insert batch's log file holds, but `offset`


@functools.lru_cache(maxsize=256)
def _log_schema_without_offset(schema: CollectionSchema) -> pa.Schema:
    return log_schema(schema).remove(0)


def _batch_schema(info: CollectionInfo) -> pa.Schema:
    """The log schema without `offset` (the writer adds it)."""
    return _log_schema_without_offset(info.schema)


# --- input conversion -------------------------------------------------------------------


def to_insert_table(
    schema: CollectionSchema, rows: pa.Table | pa.RecordBatch | Mapping[str, Any]
) -> pa.Table:
    """The rows as a table of the schema's fields in log order (pk first), with vectors as
    fixed_size_binary(dim*4), a field left out filled with its default (or nulls when it is
    nullable), the keys the schema lacks in its dynamic field when it has one. Raises
    ValueError naming the field that does not fit, and its row."""
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    names = list(rows.column_names) if isinstance(rows, pa.Table) else list(rows.keys())
    expected = [schema.primary] + [f for f in schema.fields if not f.is_primary]
    optional = {f.name for f in expected if f.nullable or f.default_value is not None}
    missing = [f.name for f in expected if f.name not in names and f.name not in optional]
    unknown = [n for n in names if n not in {f.name for f in expected}]
    dynamic = schema.dynamic_field
    if missing or (unknown and dynamic is None):
        raise ValueError(f"insert rows do not match the schema: missing {missing}, unknown {unknown}")

    def raw(name: str) -> Any:
        return rows.column(name) if isinstance(rows, pa.Table) else rows[name]

    columns = {f.name: _column(f, raw(f.name)) for f in expected if f.name in names}
    if unknown:  # the dynamic field takes them, as Milvus' `$meta`
        assert dynamic is not None
        try:
            columns[dynamic.name] = fields.pack_dynamic(
                {n: raw(n) for n in unknown}, columns.get(dynamic.name)
            )
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise ValueError(f"dynamic field {dynamic.name!r}: {exc}") from None
    lengths = {len(c) for c in columns.values()}
    if len(lengths) != 1:
        raise ValueError(f"columns differ in length: {sorted(lengths)}")
    count = lengths.pop()
    if not count:
        raise ValueError("no rows to insert")
    for f in expected:
        if f.name not in columns:
            columns[f.name] = fields.absent(f, count)
    return pa.Table.from_arrays([columns[f.name] for f in expected], names=[f.name for f in expected])


def _column(field: FieldSchema, raw: Any) -> pa.Array | pa.ChunkedArray:
    try:
        if field.is_sparse:
            return fields.sparse_array(raw)
        if field.is_vector:
            column = _vector_array(raw, field)
            if column.null_count:
                raise ValueError("has nulls")
            return column
        return _scalar_array(raw, field)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise ValueError(f"field {field.name!r}: {exc}") from None


def _scalar_array(raw: Any, field: FieldSchema) -> pa.Array | pa.ChunkedArray:
    return fields.conform(field, fields.to_arrow(field, raw))


def _vector_array(raw: Any, field: FieldSchema) -> pa.Array | pa.ChunkedArray:
    """Dense vectors as an (n, dim) matrix of floats, lists of floats or the stored bytes;
    binary vectors as `fields.binary_matrix` takes them, or the stored bytes."""
    assert field.dim is not None
    dim = field.dim
    target = fields.arrow_type(field)  # fixed_size_binary of one vector's bytes
    if isinstance(raw, pa.ChunkedArray):
        if raw.type.equals(target):
            return raw  # no copy
        raw = raw.combine_chunks()
    if isinstance(raw, pa.Array) and raw.type.equals(target):
        return raw
    if field.is_binary_vector:
        return fields.encode_binary(field, fields.binary_matrix(field, raw))
    if isinstance(raw, pa.Array):
        if (
            pa.types.is_fixed_size_list(raw.type)
            or pa.types.is_list(raw.type)
            or pa.types.is_large_list(raw.type)
        ):
            if raw.null_count:
                raise ValueError("vectors have nulls")
            lengths = pc.list_value_length(raw)
            if len(raw) and (pc.min(lengths).as_py() != dim or pc.max(lengths).as_py() != dim):
                raise ValueError(f"every vector needs {dim} values")
            raw = np.asarray(raw.flatten().to_numpy(zero_copy_only=False), dtype="<f4").reshape(-1, dim)
        else:
            raise ValueError(f"type {raw.type} is not a float vector of dim {dim}")
    matrix = np.ascontiguousarray(np.asarray(raw, dtype="<f4"))
    if matrix.ndim != 2 or matrix.shape[1] != dim:
        raise ValueError(f"expected vectors of shape (n, {dim}), got {matrix.shape}")
    return fields.encode_vectors(field, matrix)


# --- synthetic data ---------------------------------------------------------------------


def generate_rows(schema: CollectionSchema, n: int, start_pk: int = 0, seed: int = 0) -> pa.Table:
    """`n` random rows for `schema` (pks start_pk, start_pk+1, ...; a VarChar pk as those
    numbers' zero-padded text: `fields.varchar_pks`): for tests, benches, demos."""
    rng = np.random.default_rng(seed)
    pks = np.arange(start_pk, start_pk + n, dtype=np.int64)
    columns: dict[str, pa.Array] = {}
    for field in [schema.primary] + [f for f in schema.fields if not f.is_primary]:
        if field.is_primary:
            columns[field.name] = (
                pa.array(pks) if field.dtype is DataType.INT64 else fields.varchar_pks(field, pks)
            )
        elif field.is_sparse:
            columns[field.name] = fields.random_sparse(rng, n)
        elif field.is_binary_vector:
            columns[field.name] = fields.encode_binary(
                field, rng.integers(0, 256, (n, field.vector_bytes), dtype=np.uint8)
            )
        elif field.is_vector:
            assert field.dim is not None
            columns[field.name] = fields.encode_vectors(field, rng.random((n, field.dim), dtype=np.float32))
        else:
            columns[field.name] = fields.random_values(field, rng, n)
    return pa.table(columns)
