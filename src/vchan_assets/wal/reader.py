"""Reading a vchannel's write-ahead log: files found by name, head, validated ranges.

Log files are immutable once visible, so their footers (first offset, count, last
timestamp) are read once per reader and cached. A sync's files are found from the
checkpoint by name (`WalReader.files_after`), so its cost does not grow with the files
below the checkpoint. Everything read is validated against
what the file name and the collection promise; a file that cannot be read, or whose
offsets are not the ones its name says, raises `CorruptLogError` naming its path.
`read_log_file` is the same validated read for one key, usable on Spark workers.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition
from vchan_assets.storage import Storage, StorageError
from vchan_assets.wal import format as fmt
from vchan_assets.wal.format import (
    CorruptLogError,
    MsgType,
    check_msg_types,
    check_schema,
    first_offset_of,
    log_schema,
    user_fields,
    wal_key,
    wal_prefix,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WalFile:
    """One log file, described by its name and footer."""

    key: str  # relative to the storage root
    first_offset: int
    count: int
    last_timestamp: int
    size_bytes: int  # what reading the batch reads: the log file and its data file
    first_timestamp: int | None = None  # min of the timestamp column (footer statistics)
    data_key: str | None = None  # format 2: the data file
    data_bytes: int = 0  # format 2: the data file's size (part of size_bytes)

    @property
    def last_offset(self) -> int:
        return self.first_offset + self.count - 1

    @property
    def end_offset(self) -> int:
        """One past the last offset: the first offset of the next file."""
        return self.first_offset + self.count

    def overlaps(self, after_offset: int, up_to_offset: int | None) -> bool:
        """True if the file holds an offset in (after_offset, up_to_offset]."""
        return self.last_offset > after_offset and (up_to_offset is None or self.first_offset <= up_to_offset)


@dataclass(frozen=True)
class Backlog:
    """What is in the log after a position: for the sync policy (size or age)."""

    messages: int
    size_bytes: int  # sum of the sizes of the files overlapping the range (an estimate)
    files: int
    oldest_timestamp: int | None  # smallest timestamp in those files
    head: MsgPosition | None


def _meta_int(meta: dict[bytes, bytes], key: bytes, path: str) -> int:
    raw = meta.get(key)
    if raw is None:
        raise CorruptLogError(path, f"footer has no {key.decode()!r} entry")
    try:
        return int(raw)
    except ValueError:
        raise CorruptLogError(
            path, f"footer entry {key.decode()!r} is not an integer: {raw[:40]!r}"
        ) from None


@dataclass(frozen=True)
class _DataRef:
    """What a format-2 log file says of its data file."""

    key: str
    rows: int
    size_bytes: int


def _data_ref(meta: dict[bytes, bytes], path: str, count: int) -> _DataRef | None:
    """The data file a log file names (None for format 1); CorruptLogError for a format
    this code does not know (written by a newer version)."""
    version = _meta_int(meta, fmt.META_FORMAT, path) if fmt.META_FORMAT in meta else 1
    if version not in (1, fmt.FORMAT_VERSION):
        raise CorruptLogError(
            path, f"written in log format {version}; this version reads formats 1 to {fmt.FORMAT_VERSION}"
        )
    if version == 1:
        return None
    if fmt.META_DATA not in meta:
        raise CorruptLogError(path, f"footer has no {fmt.META_DATA.decode()!r} entry")
    ref = _DataRef(
        meta[fmt.META_DATA].decode(errors="replace"),
        _meta_int(meta, fmt.META_DATA_ROWS, path),
        _meta_int(meta, fmt.META_DATA_BYTES, path),
    )
    if not 0 < ref.rows <= count:
        raise CorruptLogError(path, f"footer says its data file has {ref.rows} of its {count} rows")
    return ref


def _check_footer(
    md: pq.FileMetaData, path: str, key: str, vchannel: str | None, collection_id: int | None
) -> tuple[int, int, int]:
    """(first_offset, count, last_timestamp) of a footer, checked against the file name."""
    meta = md.metadata or {}
    first = _meta_int(meta, fmt.META_FIRST_OFFSET, path)
    count = _meta_int(meta, fmt.META_COUNT, path)
    last_ts = _meta_int(meta, fmt.META_LAST_TS, path)
    named = first_offset_of(key)
    if first != named:
        raise CorruptLogError(path, f"footer says first offset {first}, the name says {named}")
    if count != md.num_rows or count <= 0:
        raise CorruptLogError(path, f"footer says {count} messages, the file has {md.num_rows} rows")
    if vchannel is not None and meta.get(fmt.META_CHANNEL, b"").decode(errors="replace") != vchannel:
        raise CorruptLogError(path, f"footer channel {meta.get(fmt.META_CHANNEL)!r} is not {vchannel!r}")
    if collection_id is not None and _meta_int(meta, fmt.META_COLLECTION, path) != collection_id:
        raise CorruptLogError(
            path, f"footer collection {meta.get(fmt.META_COLLECTION)!r} is not collection {collection_id}"
        )
    return first, count, last_ts


def _channel_of(key: str) -> str | None:
    parts = key.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "wal" else None


def _first_timestamp(md: pq.FileMetaData) -> int | None:
    try:
        index = md.schema.names.index("timestamp")
    except ValueError:
        return None
    values = []
    for i in range(md.num_row_groups):
        stats = md.row_group(i).column(index).statistics
        if stats is None or not stats.has_min_max:
            return None
        values.append(int(stats.min))
    return min(values) if values else None


def read_log_file(
    storage: Storage,
    key: str,
    schema: CollectionSchema,
    columns: list[str] | None = None,
    use_threads: bool = True,
) -> pa.Table:
    """Read one log file (and its data file, format 2) and validate it whole: footer
    against the name, columns against the collection schema, offsets dense from the
    first, message types known.

    Raises CorruptLogError, SchemaMismatchError or UnknownMessageTypeError naming the path.
    `columns` restricts the read (offset, msg_type and timestamp are always included).
    `use_threads=False` decodes on the calling thread only: for callers that already run
    one thread per core (sync tasks), where pyarrow's own pool would oversubscribe them."""
    path = storage.path(key)
    expected = log_schema(schema)
    wanted = expected.names
    if columns is not None:
        wanted = [n for n in expected.names if n in {"offset", "msg_type", "timestamp", *columns}]
    try:
        with storage.open_input_file(key) as f:
            pf = pq.ParquetFile(f, page_checksum_verification=True)
            first, count, _ = _check_footer(pf.metadata, path, key, _channel_of(key), None)
            data = _data_ref(pf.metadata.metadata or {}, path, count)
            check_schema(path, expected if data is None else fmt.SYSTEM_SCHEMA, pf.schema_arrow)
            table = pf.read(
                columns=[n for n in wanted if n in pf.schema_arrow.names], use_threads=use_threads
            )
    except FileNotFoundError:
        raise CorruptLogError(path, "the file disappeared (log truncated or removed?)") from None
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, StorageError):
            raise
        raise CorruptLogError(path, f"unreadable: {exc}") from None
    if table.num_rows != count:
        raise CorruptLogError(path, f"read {table.num_rows} rows, the footer promises {count}")
    offsets = table.column("offset").to_numpy()
    if offsets[0] != first or offsets[-1] != first + count - 1 or bool((np.diff(offsets) != 1).any()):
        raise CorruptLogError(
            path, f"offsets are not dense from {first} to {first + count - 1} as the name and footer say"
        )
    kinds = table.column("msg_type")
    if kinds.null_count:
        raise CorruptLogError(path, "msg_type has nulls")
    check_msg_types(kinds, path, first)
    target = pa.schema([expected.field(n) for n in wanted])
    user = [n for n in wanted if n not in fmt.SYSTEM_SCHEMA.names]
    if data is not None and user:
        found = _read_data(storage, data, path, schema, user, count, use_threads)
        table = pa.Table.from_arrays(
            [table.column(n) if n in table.column_names else found.column(n) for n in wanted], names=wanted
        )
    return pa.Table.from_arrays(table.columns, schema=target)


def _read_data(
    storage: Storage,
    data: _DataRef,
    log_path: str,
    schema: CollectionSchema,
    names: list[str],
    count: int,
    use_threads: bool,
) -> pa.Table:
    """The `names` columns of a format-2 data file, null past its rows up to `count`."""
    path = storage.path(data.key)
    try:
        with storage.open_input_file(data.key) as f:
            pf = pq.ParquetFile(f, page_checksum_verification=True)
            check_schema(path, pa.schema(user_fields(schema)), pf.schema_arrow)
            table = pf.read(columns=names, use_threads=use_threads)
    except FileNotFoundError:
        raise CorruptLogError(log_path, f"its data file {path} is missing") from None
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, StorageError):
            raise
        raise CorruptLogError(path, f"unreadable: {exc}") from None
    if table.num_rows != data.rows:
        raise CorruptLogError(path, f"has {table.num_rows} rows, its log file {log_path} says {data.rows}")
    tail = count - data.rows  # the batch's messages after its inserts (its time tick)
    return pa.Table.from_arrays(
        [pa.chunked_array([*c.chunks, pa.nulls(tail, c.type)]) for c in table.columns], names=names
    )


class WalReader:
    """Read side of one vchannel's log. Cheap to create; caches the immutable footers.

    A sync only needs the files after its checkpoint, and a channel's log may hold
    thousands of older ones: `files_after` finds the files it needs by their names (which
    carry their first offsets) without opening any older file, and lists only the names
    after the checkpoint where the storage can list from a key. `files` describes the
    whole log, for those who need all of it (garbage collection, checks)."""

    def __init__(self, storage: Storage, vchannel: str, collection: CollectionInfo) -> None:
        self.storage = storage
        self.vchannel = vchannel
        self.collection = collection
        self.schema = log_schema(collection.schema)
        self._footers: dict[str, WalFile] = {}
        self._ticks: dict[str, MsgPosition | None] = {}  # last time tick of a file

    # --- listing ---------------------------------------------------------------------

    def _keys(self, start_after: str | None = None) -> list[str]:
        """Sorted keys of the channel's log files (after `start_after`, if given)."""
        keys = []
        for key in self.storage.list_keys(wal_prefix(self.vchannel), start_after):
            try:
                first_offset_of(key)
            except ValueError:
                log.warning("ignoring %s: not a log file name", self.storage.path(key))
                continue
            keys.append(key)
        return keys

    def _holder_on(self, offset: int) -> list[str]:
        """Keys of the file holding `offset` and of every later file (every file if the
        log starts after `offset`), bisected from the listing of every name."""
        keys = self._keys()
        firsts = [first_offset_of(k) for k in keys]
        return keys[max(bisect.bisect_right(firsts, offset) - 1, 0) :]

    def _describe(self, key: str) -> WalFile | None:
        """The file's footer; None if there is no such file (not written yet, or deleted
        by log retention since the listing)."""
        cached = self._footers.get(key)
        if cached is not None:
            return cached
        path = self.storage.path(key)
        try:
            with self.storage.open_input_file(key) as f:
                size = f.size()
                md = pq.ParquetFile(f).metadata
        except FileNotFoundError:
            return None
        except (pa.ArrowException, OSError) as exc:
            raise CorruptLogError(path, f"unreadable footer: {exc}") from None
        first, count, last_ts = _check_footer(md, path, key, self.vchannel, self.collection.id)
        data = _data_ref(md.metadata or {}, path, count)
        data_key, data_bytes = (None, 0) if data is None else (data.key, data.size_bytes)
        described = WalFile(
            key, first, count, last_ts, size + data_bytes, _first_timestamp(md), data_key, data_bytes
        )
        self._footers[key] = described
        return described

    def _described(self, listing: Callable[[], list[str]]) -> list[WalFile]:
        """The files of a `listing` of keys, described, checked to follow each other
        without a gap.

        Log retention deletes the oldest files, in offset order, while readers list: when
        a listed file is gone by the time its footer is read, the listing is stale (files
        before it, whose footers were cached, may be gone too) and is taken again."""
        for _ in range(5):
            keys = listing()
            files = [f for f in map(self._describe, keys) if f is not None]
            if len(files) == len(keys):
                break
        else:
            raise CorruptLogError(
                self.storage.path(wal_prefix(self.vchannel)), "log files kept disappearing while listed"
            )
        for before, after in zip(files, files[1:], strict=False):
            if after.first_offset != before.end_offset:
                raise CorruptLogError(
                    self.storage.path(after.key),
                    f"starts at offset {after.first_offset} but the previous file ends at "
                    f"{before.last_offset}: the log has a gap or an overlap",
                )
        return files

    def _chain_from(self, offset: int) -> list[WalFile]:
        """The files from the one named after `offset` on, each found by the end offset
        of the one before (no listing); empty if no file starts at `offset`."""
        files: list[WalFile] = []
        while (f := self._describe(wal_key(self.vchannel, offset))) is not None:
            files.append(f)
            offset = f.end_offset
        return files

    def check_end(self, end_offset: int) -> None:
        """CorruptLogError if a file starts after `end_offset` while none starts at it:
        a hole in the log (a file removed by hand; writers never leave one)."""
        later = self._keys(start_after=wal_key(self.vchannel, end_offset - 1) if end_offset > 0 else None)
        if later and first_offset_of(later[0]) != end_offset:
            raise CorruptLogError(
                self.storage.path(later[0]),
                f"the log has a gap: no file starts at offset {end_offset}, this one starts later",
            )

    def forget_before(self, offset: int) -> None:
        """Drop the cached footers of the files that end before `offset` (a reader kept
        across reads whose checkpoint moved past them: log retention deletes them). The
        file holding `offset` stays: a tail from a checkpoint at a file's end starts there.
        Safe beside other threads' reads through the same reader (a snapshot of the items;
        a key another thread dropped first is skipped)."""
        for key, described in list(self._footers.items()):
            if described.last_offset < offset:
                self._footers.pop(key, None)

    def keys(self) -> list[str]:
        """The names of the channel's log files in offset order, none opened (for an
        operator's tools: a damaged file is listed like any other)."""
        return self._keys()

    def describe(self, key: str) -> WalFile | None:
        """One log file's footer (cached); CorruptLogError if it cannot be read, None if it
        is gone."""
        return self._describe(key)

    def files(self) -> list[WalFile]:
        """Every log file of the channel in offset order, checked to be contiguous
        (one footer read per file: for garbage collection and checks, not for syncs)."""
        return self._described(self._keys)

    def files_after(self, after_offset: int) -> list[WalFile]:
        """The files holding an offset after `after_offset` (a checkpoint), in offset
        order, checked to be contiguous; no older file is opened.

        Normally a file starts right after the checkpoint (a checkpoint is a batch's
        closing time tick): from it, each next file is named by the end offset of the one
        before, so nothing is listed. Where the storage lists from a key (S3), the end
        is checked for a hole too; locally that listing would read the whole directory,
        so `vchan status` checks it (`check_end`). Otherwise (a checkpoint inside a file,
        or nothing after it) the names are listed and the checkpoint's file bisected."""
        offset = after_offset + 1
        if offset > 0:
            chain = self._chain_from(offset)
            if chain:
                if self.storage.lists_from_key:
                    self.check_end(chain[-1].end_offset)
                return chain
        files = self._described(lambda: self._holder_on(offset))
        return [f for f in files if f.last_offset > after_offset]

    def files_between(self, after_offset: int, up_to_offset: int | None = None) -> list[WalFile]:
        """Files holding an offset in (after_offset, up_to_offset] (up to the end if None)."""
        return [f for f in self.files_after(after_offset) if f.overlaps(after_offset, up_to_offset)]

    def damaged_before(self, offset: int) -> list[CorruptLogError]:
        """The errors of the files that start before `offset` and cannot be described
        (a footer at least): damage a sync from `offset` on does not need, for reports."""
        found = []
        for key in self._keys():
            if first_offset_of(key) >= offset:
                break
            try:
                self._describe(key)
            except CorruptLogError as exc:
                found.append(exc)
        return found

    def last_file(self) -> WalFile | None:
        """The newest log file (only its footer is read)."""
        keys = self._keys()
        if not keys:
            return None
        last = self._describe(keys[-1])
        if last is None:  # retention never deletes the newest file
            raise CorruptLogError(
                self.storage.path(keys[-1]), "the newest log file disappeared while listing"
            )
        return last

    # --- positions ---------------------------------------------------------------------

    def head(self) -> MsgPosition | None:
        """Position of the latest time tick (None if the channel has none yet).

        The producer ends every batch with a time tick, so normally this is the last
        message of the last file; files are searched backwards otherwise (only the
        footers of the files searched are read)."""
        keys = self._keys()
        for key in reversed(keys):
            f = self._describe(key)
            tick = None if f is None else self._last_tick(f)
            if tick is not None:
                return tick
        return None

    def _head_of(self, files: list[WalFile]) -> MsgPosition | None:
        for f in reversed(files):
            tick = self._last_tick(f)
            if tick is not None:
                return tick
        return None

    def end_offset(self) -> int:
        """Offset after the last message (0 for an empty channel)."""
        last = self.last_file()
        return 0 if last is None else last.end_offset

    def _last_tick(self, f: WalFile) -> MsgPosition | None:
        if f.key not in self._ticks:
            table = read_log_file(self.storage, f.key, self.collection.schema, columns=["msg_type"])
            is_tick = pc.equal(table.column("msg_type"), MsgType.TIME_TICK.value).to_numpy(
                zero_copy_only=False
            )
            indexes = np.flatnonzero(is_tick)
            if len(indexes) == 0:
                self._ticks[f.key] = None
            else:
                i = int(indexes[-1])
                ts = int(table.column("timestamp")[i].as_py())
                self._ticks[f.key] = MsgPosition(self.vchannel, f.first_offset + i, ts)
        return self._ticks[f.key]

    # --- data --------------------------------------------------------------------------

    def read(self, after_offset: int = -1, up_to_offset: int | None = None) -> pa.Table:
        """Messages with offset in (after_offset, up_to_offset], validated, in offset order."""
        tables = []
        for f in self.files_between(after_offset, up_to_offset):
            table = read_log_file(self.storage, f.key, self.collection.schema)
            if f.first_offset <= after_offset or (up_to_offset is not None and f.last_offset > up_to_offset):
                start = max(after_offset + 1 - f.first_offset, 0)
                stop = f.count if up_to_offset is None else min(up_to_offset + 1 - f.first_offset, f.count)
                table = table.slice(start, stop - start)
            tables.append(table)
        if not tables:
            return self.schema.empty_table()
        return pa.concat_tables(tables)

    def size_between(self, after_offset: int = -1, up_to_offset: int | None = None) -> int:
        """Bytes of the files overlapping (after_offset, up_to_offset]: the buffered size
        a sync of that range would read."""
        return sum(f.size_bytes for f in self.files_between(after_offset, up_to_offset))

    def backlog(self, after_offset: int = -1, files: list[WalFile] | None = None) -> Backlog:
        """Messages, bytes and age of what follows `after_offset` (a channel checkpoint),
        from the `files` after it when the caller has found them already (`files_after`).
        Its head is the latest time tick after `after_offset` (None if there is none)."""
        files = self.files_after(after_offset) if files is None else files
        stamps = [f.first_timestamp for f in files if f.first_timestamp is not None]
        return Backlog(
            messages=sum(f.end_offset - max(f.first_offset, after_offset + 1) for f in files),
            size_bytes=sum(f.size_bytes for f in files),
            files=len(files),
            oldest_timestamp=min(stamps) if stamps else None,
            head=self._head_of(files),
        )
