"""Reads at a timestamp: which segments were live at T, and the log tail a read adds.

A read at T (a hybrid timestamp; default: now) returns every row inserted at or before T
and not deleted at or before T, wherever the row lives when the read runs: in a flushed
or growing segment's binlogs, or still only in the log after the channel checkpoint.

- **The time**: `resolve_as_of` turns what a caller gives (None for now, a hybrid
  timestamp, an ISO-8601 time or a datetime) into a hybrid timestamp, and refuses one in
  the future or older than VCHAN_TIME_TRAVEL (default 1 h) with `TimeTravelError`,
  naming the oldest readable time. "Now" is a timestamp from the oracles (`now_ts`):
  above every one issued before the read started, so a row acknowledged before is in it,
  and below every one issued after. A wall-clock time reads what was stamped before it:
  timestamps follow the wall clock, so every row acknowledged before that time is in the
  read, and no row whose insert began after it, down to the millisecond (a time within a
  millisecond reads that millisecond whole).
- **Segments live at T** (`segments_at`): a compaction (sort, mix) swaps inputs for
  outputs in one transaction that stamps the inputs' `dropped_ts`: the newest timestamp
  of the deletes the outputs applied (a timestamp, not the wall clock of `dropped_at`:
  timestamps run ahead of it while the oracles follow a mark ahead of the clock). At a T below it the outputs lack rows that
  deletes after T removed: `segments_at` puts the inputs back and leaves the outputs out,
  so such a row is still read at T. At or above it the outputs hold exactly the inputs'
  rows at T, and are served. GC keeps a Dropped segment's files at least VCHAN_TIME_TRAVEL for this.
- **The log tail** (`tail_of`): the messages after a vchannel's checkpoint. Its inserts
  not yet in their segment's binlogs (above the segment's dml position) are rows of the
  read; its deletes are deletes of the read. Files that start after T are not opened.
  Log retention may remove files after the checkpoint a read planned from (a sync moved
  the checkpoint past them meanwhile, with segments the read did not list): the tail then
  raises `LogMovedError` instead of reading on without them, and `replanned` plans the
  read again at the same T.

Rows are then kept when their timestamp is at or before T, and Milvus' delete rule
applies with the deletes at or before T.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.config import Settings
from vchan_assets.errors import DeclaredError
from vchan_assets.failpoints import failpoint
from vchan_assets.indexes.meta import live_indexes
from vchan_assets.meta.allocator import now_ts
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, KeyValue, MetaStore
from vchan_assets.model import (
    CollectionInfo,
    FieldIndex,
    MsgPosition,
    SegmentIndex,
    SegmentInfo,
    compose_ts,
    physical_ms,
)
from vchan_assets.query.channel_plans import channel_views, held_plans, segments_at
from vchan_assets.query.view import QueryView, checkpoints_of, collection_views, read_checkpoints
from vchan_assets.storage import Storage
from vchan_assets.storage.cache import ReadCache
from vchan_assets.wal.format import CorruptLogError, MsgType, user_fields
from vchan_assets.wal.reader import WalFile, WalReader, read_log_file

log = logging.getLogger(__name__)
R = TypeVar("R")

# A read planned this many times, each losing its log tail to retention, gives up.
READ_ATTEMPTS = 3

# The log readers of reads' tails, by (storage, vchannel, collection), kept between reads:
# each reader keeps the footers of the files it described, so a repeated read at "now" does
# not open the same log files' footers again (a reader per read did: ~0.7 ms a vchannel).
TAIL_READERS = 1024
_TAIL_READERS: ReadCache[WalReader] = ReadCache(TAIL_READERS)
# Hybrid timestamps are physical milliseconds << 18: anything below this is no such time.
_SMALLEST_TS = compose_ts(1_000_000_000_000)  # 2001-09-09
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class LogMovedError(DeclaredError, RuntimeError):
    """Log retention removed log files a read's tail needed while the read ran: the
    vchannel's checkpoint passed them after the read had read it (`replanned` plans the
    read again)."""

    vchannel: str
    after_offset: int
    first_offset: int
    message = (
        "the log of {vchannel} after offset {after_offset} was removed by log retention while "
        "the read ran (its oldest file now starts at offset {first_offset}): read again"
    )


class TimeTravelError(DeclaredError, ValueError):
    """A read's `as_of` cannot be served."""

    as_of: str
    reason: str
    message = "cannot read as of {as_of}: {reason}"


def iso(ts: int) -> str:
    """A hybrid timestamp as an ISO-8601 UTC time (milliseconds)."""
    seconds = physical_ms(ts) / 1000
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")


def _parse(as_of: Any) -> int:
    if isinstance(as_of, bool):
        raise TimeTravelError(repr(as_of), "not a timestamp")
    if isinstance(as_of, int):
        return as_of
    if isinstance(as_of, dt.datetime):
        return _stamped_before(as_of if as_of.tzinfo else as_of.replace(tzinfo=dt.UTC))
    if isinstance(as_of, str):
        text = as_of.strip()
        if text.isdigit():
            return int(text)
        try:
            return _parse(dt.datetime.fromisoformat(text.replace("Z", "+00:00")))
        except ValueError:
            pass
    raise TimeTravelError(repr(as_of), "not a timestamp (a hybrid timestamp, an ISO-8601 time or a datetime)")


def _stamped_before(moment: dt.datetime) -> int:
    """The newest hybrid timestamp stamped before `moment` at millisecond resolution: the
    last of the millisecond before it, or, for a moment within a millisecond, of that one
    (a row acknowledged before the moment was stamped in it or earlier)."""
    micros = (moment - _EPOCH) // dt.timedelta(microseconds=1)
    return compose_ts(-(-micros // 1000)) - 1


def parse_time(value: Any) -> int:
    """A hybrid timestamp from a hybrid timestamp, an ISO-8601 time or a datetime (no
    window checked); TimeTravelError for anything else."""
    ts = _parse(value)
    if ts < _SMALLEST_TS:
        raise TimeTravelError(str(value), "not a hybrid timestamp (physical milliseconds << 18)")
    return ts


def resolve_as_of(store: MetaStore, settings: Settings, as_of: Any = None) -> int:
    """The hybrid timestamp of a read at `as_of` (None: now), checked against now and the
    time-travel window."""
    now = now_ts(store)
    if as_of is None:
        return now
    ts = parse_time(as_of)
    while ts > now and physical_ms(ts) == physical_ms(now):
        # A time in the current millisecond: read once it is over, so that no timestamp
        # issued later falls at or before `ts` (the same read gives the same rows later).
        time.sleep(0.001)
        now = now_ts(store)
    if ts > now:
        raise TimeTravelError(str(as_of), f"{iso(ts)} is in the future (now is {iso(now)})")
    # The window is measured on the wall clock, as GC measures how long it keeps a dropped
    # segment: "now" is ahead of it while the oracles follow a mark ahead of the clock, and
    # the oldest readable time would move with it.
    oldest = compose_ts(int((time.time() - settings.time_travel) * 1000))
    if ts < oldest:
        raise TimeTravelError(
            str(as_of),
            f"{iso(ts)} is older than the time-travel window (VCHAN_TIME_TRAVEL={settings.time_travel:g}s): "
            f"the oldest readable time is {iso(oldest)}",
        )
    return ts


def replanned(read: Callable[[], R], attempts: int = READ_ATTEMPTS) -> R:
    """`read()` (pin, list the views, read them), planned again from fresh meta at the same
    timestamp when log retention removed part of a log tail under it (`LogMovedError`):
    the checkpoint that passed those files is then read, with the segments holding their
    rows. The error once `attempts` have lost that race."""
    for attempt in range(1, attempts + 1):
        try:
            return read()
        except LogMovedError as exc:
            if attempt == attempts:
                raise
            log.info("%s; planning the read again", exc)
    raise AssertionError("unreachable")


def views_at(
    store: MetaStore, info: CollectionInfo, ts: int
) -> tuple[Sequence[SegmentInfo], list[QueryView]]:
    """The collection's segment meta as it stood at `ts` and the query views over it
    (`meta_at`)."""
    found = meta_at(store, info, ts)
    return found.segments, found.views


@dataclass(frozen=True)
class MetaAt:
    """What a read at T lists of a collection's meta (`meta_at`)."""

    segments: Sequence[SegmentInfo]  # as they stood at T (`segments_at`), by vchannel
    views: list[QueryView]
    indexes: list[FieldIndex]  # the live indexes
    builds: list[Decoded[SegmentIndex]]  # every segment index build (when asked for)


def meta_at(
    store: MetaStore,
    info: CollectionInfo,
    ts: int,
    builds: bool = False,
    partitions: Collection[int] | None = None,
) -> MetaAt:
    """The collection's segment meta as it stood at `ts` (`segments_at`) and the query views
    over it (a mix output replaces its inputs if it was ready at `ts`: `view.index_ready`).
    The channel checkpoints, the segments, the live indexes and (`builds`) the index builds
    are read at one revision (`SegmentMeta.list_with`, paged reads; the checkpoints in the
    first pages' transaction), so the indexes and builds a search uses are those of the
    segments it lists, and no checkpoint is ahead of the segments listed with it (a sync
    commits its segment meta before its checkpoint: a checkpoint read after the listing
    could cover rows in neither; `view.read_checkpoints`). `partitions`: only the
    segments and builds of those partitions are read (a search that a filter on the
    partition key prunes reads its partitions' keys, not the collection's: their views hold
    only those partitions' segments)."""
    failpoint("read_meta")  # the read's timestamp taken; checkpoints and segment meta not read yet
    keys = store.keys
    chosen = None if partitions is None else sorted(partitions)
    if chosen is None:
        build_ranges = [keys.segment_index.under(info.id)]
    else:
        build_ranges = [keys.segment_index.under(info.id, p) for p in chosen]
    prefixes = [keys.field_index.under(info.id), *(build_ranges if builds else [])]
    exact = [keys.channel_checkpoint(v) for v in info.vchannels]
    if chosen is None and (held := _held_meta_at(store, info, ts, prefixes, exact)) is not None:
        return held
    listed, others = SegmentMeta(store).list_with(
        info.id,
        prefixes,
        True,
        None if chosen is None else (chosen, info.vchannels),
        exact=exact,
    )
    checkpoints, indexes, found = _decoded_others(store, info, others, len(prefixes))
    segments = segments_at([d.model for d in listed], ts)
    views = collection_views(store, info, segments, checkpoints, ts, indexes)
    order = {view.vchannel: i for i, view in enumerate(views)}
    segments.sort(key=lambda seg: order[seg.vchannel])  # by vchannel, as a held plan lists them
    return MetaAt(segments, views, indexes, found)


def _decoded_others(
    store: MetaStore, info: CollectionInfo, others: Sequence[Sequence[KeyValue]], prefixes: int
) -> tuple[dict[str, MsgPosition | None], list[FieldIndex], list[Decoded[SegmentIndex]]]:
    """What `meta_at` read beside the segments, decoded: the listings of its `prefixes`
    ranges (the field indexes, then the builds) and then the channel checkpoint keys."""
    ranges, at_keys = others[:prefixes], others[prefixes:]
    checkpoints = checkpoints_of(info.vchannels, [items[0] if items else None for items in at_keys])
    indexes = [d.model for d in live_indexes(store.decode_models(ranges[0], FieldIndex, True))]
    builds = store.decode_models([kv for items in ranges[1:] for kv in items], SegmentIndex, True)
    return checkpoints, indexes, builds


def _held_meta_at(
    store: MetaStore, info: CollectionInfo, ts: int, prefixes: Sequence[str], exact: Sequence[str]
) -> MetaAt | None:
    """`meta_at` of the whole collection from the process's segment cache: its records by
    vchannel, the keys under `prefixes` and the `exact` checkpoint keys read at the copy's
    revision, and each vchannel's plan kept from an earlier read where it still serves this
    one (`channel_plans`). None without a cache or when it cannot prove it is current."""
    cache = store.segment_cache
    if cache is None:
        return None
    held = SegmentMeta(store).held_channels(info.id, prefixes, True, exact)
    if held is None:
        return None
    groups, others = held
    checkpoints, indexes, found = _decoded_others(store, info, others, len(prefixes))
    if extra := [v for v in groups if v not in checkpoints]:  # a vchannel no longer the collection's
        checkpoints = {**checkpoints, **read_checkpoints(store, extra)}
    segments, views = channel_views(held_plans(cache), info, groups, checkpoints, ts, indexes)
    return MetaAt(segments, views, indexes, found)


@dataclass(frozen=True)
class LogTail:
    """What a vchannel's log holds after its checkpoint, up to a timestamp."""

    rows: pa.Table  # row_id (the log offset), timestamp, the fields, segment_id, partition_id
    deletes: Mapping[int, pa.Table]  # partition id -> pk, timestamp


@dataclass(frozen=True)
class TailPlan:
    """What a read plans from a vchannel's log tail without reading its fields: the deletes
    by partition, and how many inserts no segment holds yet."""

    deletes: Mapping[int, pa.Table]
    inserts: int


@dataclass(frozen=True)
class Tail:
    """A vchannel's log after `after_offset` (its checkpoint) up to `ts`; `persisted`:
    segment id -> the offset up to which its binlogs hold its rows."""

    vchannel: str
    after_offset: int
    persisted: Mapping[int, int]
    ts: int

    def plan(self, storage: Storage, info: CollectionInfo) -> TailPlan:
        """The deletes and the count of fresh inserts (only the pk, partition and segment
        columns of the log are read)."""
        pk = info.schema.primary.name
        log = self._messages(storage, info, [pk, "partition_id", "segment_id"])
        return TailPlan(_deletes_by_partition(log, pk), self._fresh_inserts(log).num_rows)

    def read(self, storage: Storage, info: CollectionInfo, with_vectors: bool = True) -> LogTail:
        """The inserts that no segment's binlogs hold yet, and the deletes."""
        # In the order of a segment's column groups: the pk and the scalars, then each vector.
        scalars = [f.name for f in user_fields(info.schema) if not _is_vector(info, f.name)]
        vectors = [f.name for f in user_fields(info.schema) if with_vectors and _is_vector(info, f.name)]
        fields = scalars + vectors
        log = self._messages(storage, info, [*fields, "segment_id", "partition_id"])
        rows = self._fresh_inserts(log).select(["offset", "timestamp", *fields, "segment_id", "partition_id"])
        rows = rows.rename_columns(["row_id", *rows.column_names[1:]])
        return LogTail(rows, _deletes_by_partition(log, info.schema.primary.name))

    def _messages(self, storage: Storage, info: CollectionInfo, columns: list[str]) -> pa.Table:
        """The messages at or before `ts`: offset, msg_type, timestamp and `columns`,
        validated; log files that start after `ts` are not opened."""
        reader = _TAIL_READERS.get(
            (storage, self.vchannel, info.id), lambda: WalReader(storage, self.vchannel, info)
        )
        files = self._files(reader)
        failpoint("read_tail_listed")  # the tail's log files listed, none opened yet
        tables = []
        for f in files:
            if f.first_timestamp is not None and f.first_timestamp > self.ts:
                break  # timestamps grow with offsets on a channel
            try:
                table = read_log_file(storage, f.key, info.schema, columns)
            except CorruptLogError:
                # Retention may have removed the file (or its data file) since it was
                # listed: then the vchannel's files start past this read's checkpoint now,
                # and the read plans again. Otherwise the file is damaged: say so.
                fresh = WalReader(storage, self.vchannel, info)  # no footers cached
                if not self._files(fresh):  # every file after the checkpoint removed
                    raise LogMovedError(self.vchannel, self.after_offset, f.end_offset) from None
                raise
            if f.first_offset <= self.after_offset:
                table = table.slice(self.after_offset + 1 - f.first_offset)
            tables.append(table)
        if not tables:
            names = ("offset", "msg_type", "timestamp", *columns)
            return pa.schema([reader.schema.field(n) for n in names]).empty_table()
        log = pa.concat_tables(tables)
        return log.filter(pc.less_equal(log["timestamp"], self.ts))

    def _files(self, reader: WalReader) -> list[WalFile]:
        """The log files after the read's checkpoint; LogMovedError if log retention removed
        files after it: a sync moved the checkpoint past them since the read planned. Their
        rows are in segments the read did not list; reading on would silently lose them."""
        files = reader.files_after(self.after_offset)
        reader.forget_before(self.after_offset)  # (a kept reader: not the files before the tail)
        if files and files[0].first_offset > self.after_offset + 1:
            raise LogMovedError(self.vchannel, self.after_offset, files[0].first_offset)
        return files

    def _fresh_inserts(self, log: pa.Table) -> pa.Table:
        """The inserts above their segment's dml offset: in no binlog yet."""
        inserts = log.filter(pc.equal(log["msg_type"], MsgType.INSERT.value))
        if not self.persisted or not inserts.num_rows:
            return inserts
        seg_ids = pa.array(list(self.persisted), pa.int64())
        dml = pa.array(list(self.persisted.values()), pa.int64())
        found = dml.take(pc.index_in(inserts["segment_id"], seg_ids))
        fresh = pc.or_kleene(pc.is_null(found), pc.greater(inserts["offset"], found))
        return inserts.filter(pc.fill_null(fresh, True))


def _deletes_by_partition(log: pa.Table, pk: str) -> dict[int, pa.Table]:
    deletes = log.filter(pc.equal(log["msg_type"], MsgType.DELETE.value))
    parts = pc.fill_null(deletes["partition_id"], -1)
    return {
        int(part): deletes.filter(pc.equal(parts, part))
        .select([pk, "timestamp"])
        .rename_columns(["pk", "timestamp"])
        for part in pc.unique(parts).to_pylist()
    }


def tail_of(view: QueryView, segments: Iterable[SegmentInfo], ts: int) -> Tail:
    """The tail a read at `ts` takes from the view's vchannel: after its checkpoint (the
    whole log without one)."""
    after = view.checkpoint.offset if view.checkpoint else -1
    return Tail(view.vchannel, after, persisted_offsets(segments, view.vchannel), ts)


def persisted_offsets(segments: Iterable[SegmentInfo], vchannel: str) -> dict[int, int]:
    """Segment id -> the offset up to which its binlogs hold its rows (its dml position),
    for the segments of `vchannel`: a log insert at or below it is already read from there."""
    return {s.id: s.dml_position.offset for s in segments if s.vchannel == vchannel and s.dml_position}


def at_or_before(table: pa.Table, ts: int) -> pa.Table:
    """The rows (or deletes) with a timestamp at or before `ts`."""
    if table.num_rows == 0:
        return table
    keep = pc.less_equal(table["timestamp"], ts)
    return table if pc.all(keep).as_py() else table.filter(keep)


def _is_vector(info: CollectionInfo, name: str) -> bool:
    return any(f.name == name and f.is_vector for f in info.schema.fields)
