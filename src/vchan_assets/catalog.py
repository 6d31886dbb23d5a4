"""A read-only view of the system for notebooks and scripts: pandas DataFrames out.

`Catalog.open()` reads the settings from the environment (the same VCHAN_* variables as
the `vchan` command) and connects to the embedded etcd (started if it is not running)
or to the configured etcd cluster; storage is the local directory or S3 bucket of
VCHAN_STORAGE_URI, read through pyarrow's filesystem layer. Nothing here writes.

    from vchan_assets.catalog import Catalog
    cat = Catalog.open()
    cat.collections()            # one row per collection
    cat.vchannels()              # owner node, watch state, checkpoint, lag
    cat.segments()               # state, level, rows, bytes, binlog count, sorted
    cat.binlogs(); cat.deltalogs()
    cat.imports()                # bulk import jobs: state, reason, progress, rows, segments
    cat.data_losses()            # damaged log files quarantined: the offsets lost, for good
    cat.indexes()                # vector indexes: definition, indexed rows / total, failed builds
    cat.read_collection("books") # the rows a query would see: deletes applied
    cat.search("books", vectors, k=10)  # nearest neighbours: query, pk, distance

Each table's columns and dtypes are its Arrow schema's (`catalog_tables`: declared once,
the same for an empty table as for a full one); this module reads the records and logs.

Deletes follow Milvus: a delete of primary key `pk` in partition `p` with timestamp
`t` removes every row of `p` with that pk inserted before `t` (row timestamp < t).
Where the ownership keys (docs/architecture.md, "Keys in etcd") are read directly (sessions under
`session/datanode/`, watch infos under `channelwatch/{node}/{vchannel}`), this module
depends on the key layout only, not on the coordinator's code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Unpack

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets import catalog_tables as tables
from vchan_assets import fields
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.recovery import channel_checkpoint, list_orphans
from vchan_assets.datanode.channel_state import ChannelState, read_channel_state
from vchan_assets.imports.jobs import list_jobs
from vchan_assets.indexes.meta import collection_progress
from vchan_assets.lifecycle.plans import list_plans
from vchan_assets.meta.channelwatch import REMAINING, WatchListing, list_watches
from vchan_assets.meta.errors import MetaUnavailableError, SegmentNotFoundError
from vchan_assets.meta.segment_cache import SegmentCache
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.model import (
    DYNAMIC_FIELD,
    ChannelLease,
    CollectionInfo,
    DataType,
    MsgPosition,
    NodeSession,
    SegmentInfo,
    SegmentState,
)
from vchan_assets.query import reads
from vchan_assets.query.filters import filter_mask
from vchan_assets.query.prune import parse_where
from vchan_assets.query.search_options import SearchKeywords, SearchOptions, search_options
from vchan_assets.storage import StorageError
from vchan_assets.system import System
from vchan_assets.wal.format import LogError, data_prefix, wal_prefix
from vchan_assets.wal.quarantine import list_data_losses
from vchan_assets.wal.reader import WalReader

log = logging.getLogger(__name__)

SEGMENT_TABLE_KEY = "catalog/segments.parquet"  # written by the Dagster segment_table asset


@dataclass(frozen=True)
class _Owner:
    """Who a `channelwatch/` key says holds a vchannel, and in which state."""

    vchannel: str
    node: str  # a node id, or "remaining"
    state: str | None  # the watch state; "Malformed"; None for a remaining channel
    timeout_ts: float | None
    revision: int


def _owners(watches: WatchListing) -> list[_Owner]:
    owners = [
        _Owner(e.vchannel, str(e.node_id), e.info.state.value, e.info.timeout_ts, e.kv.mod_revision)
        for e in watches.entries
    ]
    owners += [_Owner(v, REMAINING, None, None, kv.mod_revision) for v, kv in watches.remaining.items()]
    owners += [_Owner(m.vchannel, m.node, "Malformed", None, m.kv.mod_revision) for m in watches.malformed]
    return owners


class Catalog:
    """Read-only access to collections, vchannels, segments, binlogs and their rows."""

    def __init__(self, system: System, stack: Any | None = None) -> None:
        self.system = system
        self.store, self.storage, self.settings = system.store, system.storage, system.settings
        self._stack = stack  # a Stack this catalog opened (closed by close())
        self._readers: dict[str, WalReader] = {}
        self._reader_session: Any = None  # stating the index engine versions it reads (first search)
        self._segment_cache: SegmentCache | None = None  # started by hold_segment_meta()

    # --- construction -------------------------------------------------------------------

    @classmethod
    def open(cls, settings: Settings | None = None) -> Catalog:
        """Connect with `settings` (default: from the environment). Without
        VCHAN_ETCD_ENDPOINTS the embedded etcd under VCHAN_HOME is used, started if needed."""
        from vchan_assets.stack import Stack

        settings = settings or Settings.from_env()
        stack = Stack.open(settings)
        return cls(stack, stack)

    def hold_segment_meta(self, timeout: float = 600.0) -> Catalog:
        """Hold every collection's segment meta in memory, following etcd, as the DataCoord
        does (`meta.segment_cache.SegmentCache`: loaded once in pages, then one watch; a read
        first proves the copy current with etcd, two progress round trips). For a catalog
        that serves many searches or reads of large collections: a search's plan then reads
        the collection's index keys and channel checkpoints from etcd, not its segment
        values (at 100,000 segments, 184 MB a plan), and keeps each vchannel's part of it
        until one of that vchannel's segments changes (`query.channel_plans`). Costs the
        load (about 20 s and 900 MB of memory at 100,000 segments), a first search that
        decodes every record, and the memory while held; released by `close`.
        A copy that cannot prove it is current (etcd unreachable, its stream down) is not
        used: the reads list etcd as without it. Raises MetaUnavailableError if the first
        load takes longer than `timeout` seconds."""
        if self._segment_cache is not None:
            return self
        cache = SegmentCache(self.store).start()
        if not cache.wait_loaded(timeout):
            cache.stop()
            raise MetaUnavailableError(
                tuple(self.settings.etcd_endpoints or ("embedded",)),
                f"the load of segment meta under {self.store.keys.segment.prefix}",
                f"not loaded in {timeout:.0f}s",
            )
        self.store.segment_cache = self._segment_cache = cache
        return self

    def close(self) -> None:
        if self._segment_cache is not None:
            self.store.segment_cache = None
            self._segment_cache.stop()
            self._segment_cache = None
        if self._reader_session is not None:
            self._reader_session.close()
            self._reader_session = None
        if self._stack is not None:
            # An embedded etcd that another command started keeps running.
            self._stack.close()
            self._stack = None

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- raw reads (typed) ----------------------------------------------------------------

    def collection_infos(self, include_dropped: bool = False) -> list[CollectionInfo]:
        return CollectionRegistry(self.store).list(include_dropped=include_dropped)

    def collection(self, name: str) -> CollectionInfo:
        return CollectionRegistry(self.store).get_by_name(name)

    def segment_infos(
        self, collection_id: int | None = None, include_dropped: bool = True
    ) -> list[SegmentInfo]:
        """The segments of a collection (of every one without), the Dropped ones GC has not
        deleted yet included unless `include_dropped` is False."""
        door = SegmentMeta(self.store)
        return [
            d.model for d in door.list(collection_id, skip_malformed=True, include_dropped=include_dropped)
        ]

    def sessions(self) -> list[NodeSession]:
        """Live DataNode sessions (a session key disappears with its etcd lease)."""
        found, _ = self.store.list_models(self.store.keys.datanode_session.prefix, NodeSession, True)
        return [d.model for d in found]

    def watches(self) -> WatchListing:
        """Every key under `channelwatch/`: watch infos, channels waiting as remaining, and
        malformed keys with their errors."""
        return list_watches(self.store)

    def leases(self) -> dict[str, ChannelLease]:
        root = self.store.keys.channel_lease.prefix
        found, _ = self.store.list_models(root, ChannelLease, True)
        return {d.kv.key[len(root) :]: d.model for d in found}

    def checkpoints(self) -> dict[str, tuple[MsgPosition, int]]:
        """vchannel -> (checkpoint, number of times it was committed: the key's version)."""
        root = self.store.keys.channel_checkpoint.prefix
        found, _ = self.store.list_models(root, MsgPosition, True)
        return {d.kv.key[len(root) :]: (d.model, d.kv.version) for d in found}

    def channel_state(self, info: CollectionInfo, vchannel: str, segments: bool = True) -> ChannelState:
        """The vchannel's read model: checkpoint, log, backlog, segments unless not asked
        for (datanode.channel_state)."""
        return read_channel_state(self.store, self.reader(info, vchannel), segments)

    def reader(self, info: CollectionInfo, vchannel: str) -> WalReader:
        key = f"{info.id}/{vchannel}"
        if key not in self._readers:
            self._readers[key] = WalReader(self.storage, vchannel, info)
        return self._readers[key]

    # --- DataFrames ----------------------------------------------------------------------

    def collections(self, include_dropped: bool = False) -> pd.DataFrame:
        """One row per collection: id, name, fields, partitions, vchannels, segment and row
        counts (`catalog_tables.COLLECTIONS`)."""
        segments = self.segment_infos(include_dropped=False)  # the counts are of live segments
        return tables.COLLECTIONS.frame(
            tables.collection_row(info, [s for s in segments if s.collection_id == info.id])
            for info in self.collection_infos(include_dropped)
        )

    def vchannels(self, collection: str | None = None, now: float | None = None) -> pd.DataFrame:
        """One row per vchannel (`catalog_tables.VCHANNELS`): owner node and watch state
        (from `channelwatch/`), lease holder, checkpoint, log head (latest time tick) and lag.

        `lag_rows` is the number of log messages after the checkpoint (inserts, deletes,
        time ticks); `lag_seconds` is the time between the checkpoint's timestamp and the
        head's; `checkpoint_age_seconds` is how old the checkpoint's timestamp is now.
        While the log after the checkpoint cannot be read (`log_error`: the sync stops
        there too), the lag is unknown: `lag_rows` and `end_offset` are null (<NA>), never 0.
        `log_damaged` lists damaged files wholly below the checkpoint: syncs never read
        them again, so they stop nothing (one footer read per such file, in this report)."""
        now = time.time() if now is None else now
        watches: dict[str, list[_Owner]] = {}
        for owner in _owners(self.watches()):
            watches.setdefault(owner.vchannel, []).append(owner)
        leases = self.leases()
        live = {str(s.node_id) for s in self.sessions()}
        rows = []
        for info in self.collection_infos():
            if collection is not None and info.name != collection:
                continue
            for vchannel in info.vchannels:
                rows.append(self._vchannel_row(info, vchannel, watches.get(vchannel, []), leases, live, now))
        return tables.VCHANNELS.frame(rows)

    def _vchannel_row(
        self,
        info: CollectionInfo,
        vchannel: str,
        entries: list[_Owner],
        leases: dict[str, ChannelLease],
        live: set[str],
        now: float,
    ) -> dict[str, Any]:
        # A channel being moved has two keys (ToRelease on the old node, ToWatch on the
        # new); the newest key is the one that says where it is going.
        entry = max(entries, key=lambda e: e.revision) if entries else None
        owner = entry.node if entry else None
        state = entry.state if entry else None
        lease = leases.get(vchannel)
        error, damaged = "", []
        end_offset: int | None = None  # unknown while the log after the checkpoint is unreadable
        try:
            channel = self.channel_state(info, vchannel, segments=False)  # a row needs no segment
            committed, files, head = channel.committed, list(channel.unsynced_files), channel.head
            self.reader(info, vchannel).check_end(channel.end_offset)  # a hole stops the sync there
            end_offset = channel.end_offset
            synced_below = files[0].first_offset if files else end_offset
            damaged = [str(exc) for exc in self.reader(info, vchannel).damaged_before(synced_below)]
        except (LogError, StorageError) as exc:
            # One unreadable log must not hide every other channel: report it in the row.
            log.error("vchannel %s: %s", vchannel, exc)
            committed, files, head, error = channel_checkpoint(self.store, vchannel), [], None, str(exc)
        listed = self.storage.list_files(wal_prefix(vchannel))
        data = self.storage.list_files(data_prefix(vchannel))  # the log's data files (format 2)
        cp = committed.model if committed else None
        after = cp.offset if cp else -1
        backlog_files = [f for f in files if f.overlaps(after, None)]
        cp_ts = cp.timestamp if cp else None
        lag_seconds = None
        if head is not None:
            base = (
                cp_ts if cp_ts else (files[0].first_timestamp if files and files[0].first_timestamp else None)
            )
            if base is not None:
                lag_seconds = max(0.0, tables.ts_seconds(head.timestamp) - tables.ts_seconds(base))
        return {
            "vchannel": vchannel,
            "collection": info.name,
            "collection_id": info.id,
            "owner_node": owner,
            "owner_alive": (owner in live) if owner not in (None, REMAINING) else False,
            "watch_state": state,
            "watch_timeout_at": tables.utc(entry.timeout_ts) if entry else None,
            "lease_id": lease.lease_id if lease else None,
            "lease_node": lease.node_id if lease else None,
            "checkpoint_offset": cp.offset if cp else None,
            "checkpoint_ts": cp_ts,
            "checkpoint_time": tables.utc(tables.ts_seconds(cp_ts)) if cp_ts else None,
            "syncs": committed.kv.version if committed else 0,
            "head_offset": head.offset if head else None,
            "head_ts": head.timestamp if head else None,
            "head_time": tables.utc(tables.ts_seconds(head.timestamp)) if head else None,
            "end_offset": end_offset,
            "lag_rows": None if end_offset is None else max(0, end_offset - 1 - after),
            "lag_seconds": lag_seconds,
            "checkpoint_age_seconds": max(0.0, now - tables.ts_seconds(cp_ts)) if cp_ts else None,
            "log_files": len(listed),
            "log_bytes": sum(int(i.size or 0) for i in [*listed, *data]),
            "backlog_bytes": None if error else sum(f.size_bytes for f in backlog_files),
            "log_error": error,
            "log_damaged": damaged,
        }

    def segments(self, collection: str | None = None, include_dropped: bool = True) -> pd.DataFrame:
        """One row per segment (`catalog_tables.SEGMENTS`): state, level, rows, bytes
        (insert, delta, stats), file counts, sorted or not, invisible (flushed, served as
        growing until its sorted copy replaces it), positions, lineage
        (`compaction_from`), when its flush made it Flushed and, for one its sort
        replaced, the seconds from that flush to the sort's commit (`flush_to_sorted_s`)."""
        return tables.SEGMENTS.frame(self._segment_rows(collection, include_dropped))

    def _segment_rows(self, collection: str | None, include_dropped: bool) -> list[dict[str, Any]]:
        names = self._names()
        return [
            tables.segment_row(seg, names.get(seg.collection_id))
            for seg in self._segments_of(collection)
            if include_dropped or seg.state is not SegmentState.DROPPED
        ]

    def compactions(self, collection: str | None = None) -> pd.DataFrame:
        """One row per compaction plan (`meta/compaction/`, `catalog_tables.COMPACTIONS`):
        type, state, reason, inputs and reserved outputs, rows and bytes in and out, times."""
        names = self._names()
        return tables.COMPACTIONS.frame(
            tables.plan_row(p, names.get(p.collection_id))
            for p in (d.model for d in list_plans(self.store))
            if collection is None or names.get(p.collection_id) == collection
        )

    def data_losses(self, collection: str | None = None) -> pd.DataFrame:
        """One row per damaged file an operator quarantined (`vchan quarantine`,
        `meta/data-loss/`, `catalog_tables.DATA_LOSSES`): a log file's channel and offsets
        lost, or a binlog's segment and rows lost; where the file was and is kept, why it
        was unreadable, when. Never emptied: a loss stays visible for good."""
        names = self._names()
        return tables.DATA_LOSSES.frame(
            tables.loss_row(loss, names.get(loss.collection_id, str(loss.collection_id)))
            for loss in list_data_losses(self.system)
            if collection is None or names.get(loss.collection_id) == collection
        )

    def imports(self, collection: str | None = None) -> pd.DataFrame:
        """One row per bulk import job (`meta/import/`, `catalog_tables.IMPORTS`): state,
        reason, progress, files, rows counted by pre-import and rows imported, segments,
        times."""
        return tables.IMPORTS.frame(
            tables.import_row(j)
            for j in (d.model for d in list_jobs(self.store))
            if collection is None or j.collection == collection
        )

    def indexes(self, collection: str | None = None) -> pd.DataFrame:
        """One row per live vector index (`meta/field-index/`, `catalog_tables.INDEXES`):
        its definition and how far its builds are over the collection's Flushed segments:
        indexed rows / total rows, builds finished, pending, in progress, failed (with
        reasons by segment) and segments waiting for a build (not sorted yet)."""
        infos = [self.collection(collection)] if collection else self.collection_infos()
        return tables.INDEXES.frame(
            tables.index_row(info, p) for info in infos for p in collection_progress(self.store, info)
        )

    def binlogs(self, collection: str | None = None) -> pd.DataFrame:
        """One row per insert binlog file (per column group), with its segment
        (`catalog_tables.BINLOGS`)."""
        return tables.BINLOGS.frame(
            tables.binlog_row(seg, group, b)
            for seg in self._segments_of(collection)
            for group in seg.binlogs
            for b in group.logs
        )

    def deltalogs(self, collection: str | None = None) -> pd.DataFrame:
        """One row per delta log file (deletes: pk, timestamp; `catalog_tables.DELTALOGS`)."""
        segments = self._segments_of(collection)
        return tables.DELTALOGS.frame(tables.file_row(seg, b) for seg in segments for b in seg.deltalogs)

    def statslogs(self, collection: str | None = None) -> pd.DataFrame:
        """One row per stats log file (the columns of `deltalogs`)."""
        segments = self._segments_of(collection)
        return tables.DELTALOGS.frame(tables.file_row(seg, b) for seg in segments for b in seg.statslogs)

    def write_segment_table(self, key: str = SEGMENT_TABLE_KEY) -> tuple[str, pa.Table]:
        """Write `segments()` (every collection, dropped included) as one Parquet table
        (what the Dagster `segment_table` asset materializes); its path and the table."""
        table = tables.SEGMENTS.arrow(self._segment_rows(None, include_dropped=True))
        self.storage.write_parquet(key, table)
        return self.storage.path(key), table

    def segment_table(self, key: str = SEGMENT_TABLE_KEY) -> pd.DataFrame:
        """The `segment_table` Dagster asset's table (`{storage}/catalog/segments.parquet`):
        every segment as of its last materialization. `segments()` reads etcd live instead."""
        if not self.storage.exists(key):
            raise FileNotFoundError(
                f"{self.storage.path(key)} does not exist: materialize the segment_table asset "
                "(Dagster) first, or use Catalog.segments()"
            )
        return tables.SEGMENTS.pandas(self.storage.read_parquet(key))

    def orphans(self) -> list[str]:
        """Binlog files no segment meta points to (garbage-collection candidates)."""
        return list_orphans(self.store, self.storage)

    def _names(self) -> dict[int, str]:
        """Collection names by id, dropped collections included."""
        return {c.id: c.name for c in self.collection_infos(include_dropped=True)}

    def _segments_of(self, collection: str | None) -> list[SegmentInfo]:
        if collection is None:
            return sorted(self.segment_infos(), key=lambda s: (s.collection_id, s.vchannel, s.id))
        info = self.collection(collection)
        return sorted(self.segment_infos(info.id), key=lambda s: (s.vchannel, s.id))

    # --- rows ----------------------------------------------------------------------------

    def segment(self, segment_id: int) -> SegmentInfo:
        for seg in self.segment_infos():
            if seg.id == segment_id:
                return seg
        raise SegmentNotFoundError(segment_id)

    def read_segment(
        self, segment_id: int, apply_deletes: bool = True, as_arrow: bool = False
    ) -> pd.DataFrame | pa.Table:
        """The rows of one segment (`query.reads.read_segment`): row_id, timestamp, the
        primary key, scalars and vectors (fixed_size_binary, little-endian float32; a sparse
        vector in pandas a dict {index: value}); with
        `apply_deletes`, rows deleted later in the same partition are removed. An L0
        segment returns its deletes (pk, timestamp, offset)."""
        seg = self.segment(segment_id)
        info = CollectionRegistry(self.store).get(seg.collection_id, include_dropped=True)
        table = reads.read_segment(self.system, info, seg, apply_deletes)
        return table if as_arrow else table.to_pandas(maps_as_pydicts="strict")  # sparse: {index: value}

    def read_collection(
        self,
        name: str,
        apply_deletes: bool = True,
        as_arrow: bool = False,
        with_vectors: bool = True,
        as_of: Any = None,
        pks: Iterable[int] | Iterable[str] | None = None,
        where: Sequence[tuple[str, str, Any]] | None = None,
        filter: str | None = None,
    ) -> pd.DataFrame | pa.Table:
        """Every row of a collection at `as_of` (None: now; a hybrid timestamp, an ISO-8601
        time or a datetime within VCHAN_TIME_TRAVEL), wherever it lives: the segments the
        query views serve and the log after each checkpoint (`query.reads.read_collection`),
        with `segment_id` and `partition_id` columns, deletes at or before `as_of` applied
        per partition: a pandas DataFrame (or an Arrow table with `as_arrow`). The same rows
        as a Spark DataFrame: `spark_collection(name, as_of=...)`.

        `pks` (those primary keys only) and `where` (conditions `(column, op, value)`, all of
        which hold: the primary key with `=`, `in`, `<`, `<=`, `>`, `>=`, `between`, or
        `"partition"` with `=`, `in`) are pushed down: segments whose stats logs (pk range,
        bloom filter) rule them out are not read, nor partitions not asked for. `filter` is
        then applied to the rows read: a pandas expression over the scalar fields with
        Milvus' JSON paths and array functions, as a search's (`query.filters`:
        `meta["color"] == 'red' and array_contains(tags, 'x')`). pandas gets a sparse vector
        as a dict {index: value}, as inserted."""
        info = self.collection(name)
        conditions = [
            *(where or ()),
            *([(info.schema.primary.name, "in", list(pks))] if pks is not None else []),
        ]
        pushdown = parse_where(info, conditions)
        table = reads.read_collection(
            self.system, info, apply_deletes, with_vectors, as_of=as_of, pushdown=pushdown
        )
        key = info.schema.partition_key
        for column, op, value in where or ():  # a key's partitions hold other keys' rows too
            if key is not None and column == key.name:
                wanted = pa.array(list(value) if op == "in" else [value], fields.arrow_type(key))
                table = table.filter(pc.is_in(table[column], value_set=wanted))
        if filter is not None:
            table = table.filter(pa.array(_filter_rows(info, table, filter)))
        return table if as_arrow else table.to_pandas(maps_as_pydicts="strict")  # sparse: {index: value}

    def search(
        self,
        collection: str,
        vectors: Any,
        options: SearchOptions | None = None,
        *,
        as_arrow: bool = False,
        **keywords: Unpack[SearchKeywords],
    ) -> pd.DataFrame | pa.Table:
        """The k nearest rows of each query vector (`vectors`: one vector or an (n, dim)
        array; for a sparse field, {index: value} dicts, (indices, values) pairs or a
        scipy.sparse matrix) as `options` ask (`query.search_options.SearchOptions`), or the keywords
        that make them (k=10, filter=None, as_of=None, params=None, field=None,
        metric=None, output_fields=(); not both), through the segments' indexes where
        they are built and exactly elsewhere (`query.search`): one row per hit, `query`
        (the query's position), the primary key, `distance` (squared L2; inner product
        or cosine similarity for IP and COSINE; bits that differ for HAMMING, 1 - |a and
        b| / |a or b| for JACCARD) and the `output_fields`. Binary vectors are queried as
        an (n, dim / 8) uint8 matrix of packed bits (or `bytes` each). `as_of`: None
        (now) or a time; `field`: the vector field (needed when there are several);
        `metric`: the index's (without one: L2, HAMMING for binary vectors, IP for sparse
        ones); `params`: `nprobe` (IVF, BIN_IVF_FLAT), `ef` (HNSW) or `drop_ratio_search`
        (the sparse indexes);
        `filter`: a pandas expression over the scalar fields (`"n > 3 and tag == 'a'"`)
        or a pyarrow.compute expression. Deleted rows are never returned. A segment whose
        index cannot be used (its file missing or unreadable: a rebuild is queued; or of
        an index engine version this process does not read) is searched exactly, with an
        `IndexFallbackWarning`, and listed in the frame's `attrs["exact_segments"]` (the
        Arrow table's metadata: `query.search.exact_segments`). The first search of a
        catalog that opened its own connection (`Catalog.open`) registers its reader
        session (`indexes.engine`), closed with the catalog; one made on a given system
        states it with `state_index_engine()`."""
        from vchan_assets.query.search import exact_segments, search

        chosen = search_options(collection, options, **keywords)
        info = self.collection(collection)
        if self._stack is not None:
            self.state_index_engine()
        table = search(self.system, info, vectors, chosen)
        if as_arrow:
            return table
        frame = table.to_pandas()
        frame.attrs["exact_segments"] = exact_segments(table)
        return frame

    def search_dataframe(
        self,
        collection: str,
        queries: Any,
        options: SearchOptions | None = None,
        *,
        id_column: str = "query",
        vector_column: str = "vector",
        by: Literal["segment", "query"] = "segment",
        **keywords: Unpack[SearchKeywords],
    ) -> Any:
        """Batch search in Spark (`query.batch_search`): the k nearest rows of each query of
        the Spark DataFrame `queries` (an integer `id_column` and an array-of-floats
        `vector_column` per row; for binary vectors, a binary column of their bytes), one Spark task per segment (`by="segment"`) or per slice
        of the queries (`by="query"`); the same hits as `search` (the same `options` or
        keywords: k, field, metric, filter, as_of, params, output_fields), as a Spark
        DataFrame of `id_column`, the primary key, `distance` and the output fields."""
        from vchan_assets.query.batch_search import search_dataframe

        chosen = search_options(collection, options, **keywords)
        info = self.collection(collection)
        if self._stack is not None:
            self.state_index_engine()
        return search_dataframe(
            self.system, info, queries, chosen, id_column=id_column, vector_column=vector_column, by=by
        )

    def state_index_engine(self) -> None:
        """Register this catalog's reader session, stating the index engine versions it
        reads (builds then stay loadable by it), unless it has one."""
        from vchan_assets.indexes.engine import reader_session

        if self._reader_session is None or not self._reader_session.alive:
            self._reader_session = reader_session(self.store, self.settings.session_ttl)

    def spark_collection(
        self, name: str, with_vectors: bool = True, spark: Any = None, **options: str
    ) -> Any:
        """The rows of `read_collection` as a Spark DataFrame (`format("vchan")` on this
        catalog's etcd and storage; deletes always applied, vectors as array<float>);
        `options` are the data source's (partition, segments, fields, vectors, task_mb, as_of)."""
        from vchan_assets.query.spark_source import read_options, spark_session

        info = self.collection(name)  # fails here, naming the collection, if it is unknown
        if not with_vectors and "fields" not in options:
            options["fields"] = ",".join(f.name for f in info.schema.fields if not f.is_vector)
        spark = spark_session(self.system.with_spark(spark) if spark else self.system)
        reader = spark.read.format("vchan").options(**read_options(self.settings, self.store.endpoints))
        return reader.options(collection=name, **options).load()

    def spark_changes(self, name: str, stream_id: str, spark: Any = None, **options: str) -> Any:
        """The collection's changes as a streaming Spark DataFrame
        (`readStream.format("vchan")` on this catalog's etcd and storage): every insert and
        delete of its log, once, with `op`, `ts`, `vchannel` and `offset`. `stream_id`
        names the stream in etcd (keep it across the query's restarts); `options` are the
        stream's (startingOffsets, upTo, maxRowsPerTrigger, fields, vectors): see
        docs/streams.md."""
        from vchan_assets.query.spark_source import read_options, spark_session

        self.collection(name)  # fails here, naming the collection, if it is unknown
        spark = spark_session(self.system.with_spark(spark) if spark else self.system)
        reader = spark.readStream.format("vchan").options(**read_options(self.settings, self.store.endpoints))
        return reader.options(collection=name, streamId=stream_id, **options).load()

    def __iter__(self) -> Iterator[CollectionInfo]:
        return iter(self.collection_infos())


def _filter_rows(info: CollectionInfo, table: pa.Table, expression: str) -> Any:
    scalars = [f.name for f in info.schema.scalar_fields if f.name in table.column_names]
    json_fields = [f.name for f in info.schema.fields if f.dtype is DataType.JSON]
    return filter_mask(expression, table.select(scalars), json_fields, DYNAMIC_FIELD)
