"""What the Dagster layer asks of the system, as a plain class (no Dagster import).

`VchanRuntime` wraps the metastore, storage and settings of one run or sensor tick and
answers the questions assets, checks and sensors ask: which channels exist, how far
behind a channel is (for the sync policies), sync one channel under its lease, and
the invariant checks over what is committed. Usable and testable without Dagster.

Invariant checks (docs/architecture.md, "Invariants"), for one vchannel, over the *committed range*
(start position, channel checkpoint]:

- `log_rows`: the insert binlogs hold exactly the log's inserts of that range and the
  delta logs exactly its deletes. Deletes are not applied to insert binlogs (they go to
  L0 delta logs, as in Milvus 2.4+), so "rows minus deletes where they belong" is: the
  sum of entries of the L1 scalar-group insert binlogs == the number of Insert messages
  in the range, the sum of entries of the L0 delta logs == the number of Delete
  messages in the range, and the live rows = inserted pks - deleted pks that had been
  inserted before (reported, not compared).
- `unique_pks`: no primary key appears twice in the channel's insert binlogs.
- `binlog_paths`: every binlog, delta log and stats log path in segment meta exists.
- checkpoint monotonic: checked by the asset layer against the previous
  materialization of `channel_checkpoints` (Dagster's event log keeps the history).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionCatalog, VchannelNotFoundError
from vchan_assets.datacoord.leases import current_lease
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.datanode.channel_state import read_channel_state
from vchan_assets.datanode.policies import ChannelBacklog, channel_backlog, sync_reasons
from vchan_assets.datanode.sync import Engine, SyncResult, SyncTask
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, SegmentInfo, SegmentLevel
from vchan_assets.storage import Storage
from vchan_assets.wal.format import MsgType
from vchan_assets.wal.reader import WalReader

# A Spark job of a sync that takes longer is cancelled (a hung Python worker must not
# hold the channel's run slot for the 600 s default); the sensor asks again.
SYNC_JOB_TIMEOUT = 120.0


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, int | float | str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChannelStatus:
    vchannel: str
    collection: CollectionInfo
    backlog: ChannelBacklog
    lease_id: int | None
    lease_node: int | None


class VchanRuntime:
    """Metastore + storage + settings; one per run or sensor tick (`open_runtime`)."""

    def __init__(self, settings: Settings, store: MetaStore, storage: Storage) -> None:
        self.settings = settings
        self.store = store
        self.storage = storage

    # --- channels ---------------------------------------------------------------------

    def collections(self) -> list[CollectionInfo]:
        return CollectionCatalog(self.store).list()

    def vchannels(self) -> dict[str, CollectionInfo]:
        return {v: info for info in self.collections() for v in info.vchannels}

    def collection_of(self, vchannel: str) -> CollectionInfo:
        found = self.vchannels().get(vchannel)
        if found is None:
            raise VchannelNotFoundError(vchannel)
        return found

    def status(self, vchannel: str, collection: CollectionInfo | None = None) -> ChannelStatus:
        """The channel's backlog for the sync policies, and its current lease."""
        info = collection or self.collection_of(vchannel)
        state = read_channel_state(self.store, WalReader(self.storage, vchannel, info))
        lease = self.store.read_lease(vchannel)
        return ChannelStatus(
            vchannel,
            info,
            channel_backlog(state),
            lease.lease_id if lease else None,
            lease.node_id if lease else None,
        )

    def sync_reasons(self, status: ChannelStatus, now: float | None = None) -> list[str]:
        return sync_reasons(status.backlog, self.settings, now)

    def sync(self, vchannel: str, lease_id: int, engine: Engine = "spark") -> SyncResult:
        """One sync of `vchannel` by the holder of `lease_id` (LeaseLostError if it moved)."""
        info = self.collection_of(vchannel)
        lease = current_lease(self.store, vchannel, lease_id)
        task = SyncTask(
            self.store,
            self.storage,
            self.settings,
            info,
            vchannel,
            lease,
            engine=engine,
            job_timeout=SYNC_JOB_TIMEOUT,
        )
        return task.run()

    def checkpoint(self, vchannel: str) -> MsgPosition | None:
        cp = channel_checkpoint(self.store, vchannel)
        return cp.model if cp else None

    def segments(self, vchannel: str | None = None) -> list[SegmentInfo]:
        found, _ = self.store.list_models(self.store.keys.segments(), SegmentInfo)
        return [d.model for d in found if vchannel is None or d.model.vchannel == vchannel]

    # --- invariant checks -----------------------------------------------------------------

    def _log_columns(self, vchannel: str, info: CollectionInfo, up_to: int) -> pa.Table:
        reader = WalReader(self.storage, vchannel, info)
        pk = info.schema.primary.name
        tables = []
        for f in reader.files_between(-1, up_to):
            with self.storage.filesystem.open_input_file(self.storage.path(f.key)) as handle:
                tables.append(pq.read_table(handle, columns=["offset", "msg_type", pk]))
        if not tables:
            return pa.table(
                {
                    "offset": pa.array([], pa.int64()),
                    "msg_type": pa.array([], pa.string()),
                    pk: pa.array([], pa.int64()),
                }
            )
        table = pa.concat_tables(tables)
        return table.filter(pc.less_equal(table["offset"], up_to))

    def _read(self, key: str, columns: list[str]) -> pa.Table:
        with self.storage.filesystem.open_input_file(self.storage.path(key)) as handle:
            return pq.read_table(handle, columns=columns)

    def check_log_rows(self, vchannel: str) -> CheckOutcome:
        info = self.collection_of(vchannel)
        cp = self.checkpoint(vchannel)
        if cp is None:
            return CheckOutcome(True, "no checkpoint yet: nothing committed", {"log_inserts": 0})
        log_table = self._log_columns(vchannel, info, cp.offset)
        kinds = log_table["msg_type"]
        log_inserts = pc.sum(pc.equal(kinds, MsgType.INSERT.value)).as_py() or 0
        log_deletes = pc.sum(pc.equal(kinds, MsgType.DELETE.value)).as_py() or 0
        segs = self.segments(vchannel)
        binlog_rows = sum(
            b.entries
            for s in segs
            if s.level is not SegmentLevel.L0
            for g in s.binlogs
            if g.group == 0
            for b in g.logs
        )
        delta_rows = sum(b.entries for s in segs for b in s.deltalogs)
        pk = info.schema.primary.name
        inserted = set(log_table.filter(pc.equal(kinds, MsgType.INSERT.value))[pk].to_pylist())
        deleted = set(log_table.filter(pc.equal(kinds, MsgType.DELETE.value))[pk].to_pylist())
        live = len(inserted - deleted)
        passed = binlog_rows == log_inserts and delta_rows == log_deletes
        return CheckOutcome(
            passed,
            f"committed range (start, {cp.offset}]: insert binlogs {binlog_rows} / log inserts {log_inserts}, "
            f"delta logs {delta_rows} / log deletes {log_deletes}, live rows {live}",
            {
                "checkpoint_offset": cp.offset,
                "log_inserts": log_inserts,
                "binlog_rows": binlog_rows,
                "log_deletes": log_deletes,
                "deltalog_rows": delta_rows,
                "live_rows": live,
            },
        )

    def check_unique_pks(self, vchannel: str) -> CheckOutcome:
        info = self.collection_of(vchannel)
        pk = info.schema.primary.name
        columns = []
        for s in self.segments(vchannel):
            if s.level is SegmentLevel.L0:
                continue
            for g in s.binlogs:
                if g.group != 0:
                    continue
                for b in g.logs:
                    columns.append(self._read(b.path, [pk])[pk])
        if not columns:
            return CheckOutcome(True, "no insert binlogs yet", {"rows": 0, "duplicates": 0})
        pks = pa.chunked_array([c for col in columns for c in col.chunks], type=pa.int64())
        distinct = len(pc.unique(pks))
        dupes = len(pks) - distinct
        return CheckOutcome(
            dupes == 0,
            f"{len(pks)} rows, {distinct} distinct primary keys",
            {"rows": len(pks), "duplicates": dupes},
        )

    def check_binlog_paths(self, vchannel: str) -> CheckOutcome:
        missing = []
        total = 0
        for s in self.segments(vchannel):
            for b in (*s.binlog_files, *s.deltalogs, *s.statslogs):
                total += 1
                if not self.storage.exists(b.path):
                    missing.append(b.path)
        return CheckOutcome(
            not missing,
            f"{total} paths in segment meta, {len(missing)} missing"
            + (f": {', '.join(missing[:5])}" if missing else ""),
            {"paths": total, "missing": len(missing)},
        )

    # --- catalog ------------------------------------------------------------------------

    def segment_table(self) -> pa.Table:
        """One row per segment of every collection (what notebooks read)."""
        rows = []
        for s in self.segments():
            rows.append(
                {
                    "segment_id": s.id,
                    "collection_id": s.collection_id,
                    "partition_id": s.partition_id,
                    "vchannel": s.vchannel,
                    "state": s.state.value,
                    "level": s.level.value,
                    "num_rows": s.num_rows,
                    "binlog_files": len(s.binlog_files),
                    "deltalog_files": len(s.deltalogs),
                    "binlog_bytes": sum(b.size_bytes for b in s.binlog_files),
                    "deltalog_bytes": sum(b.size_bytes for b in s.deltalogs),
                    "start_offset": s.start_position.offset if s.start_position else None,
                    "dml_offset": s.dml_position.offset if s.dml_position else None,
                    "dml_ts": s.dml_position.timestamp if s.dml_position else None,
                    "is_sorted": s.is_sorted,
                    "last_flush_ts": s.last_flush_ts,
                }
            )
        schema = pa.schema(
            [
                ("segment_id", pa.int64()),
                ("collection_id", pa.int64()),
                ("partition_id", pa.int64()),
                ("vchannel", pa.string()),
                ("state", pa.string()),
                ("level", pa.string()),
                ("num_rows", pa.int64()),
                ("binlog_files", pa.int64()),
                ("deltalog_files", pa.int64()),
                ("binlog_bytes", pa.int64()),
                ("deltalog_bytes", pa.int64()),
                ("start_offset", pa.int64()),
                ("dml_offset", pa.int64()),
                ("dml_ts", pa.int64()),
                ("is_sorted", pa.bool_()),
                ("last_flush_ts", pa.int64()),
            ]
        )
        return pa.Table.from_pylist(rows, schema=schema)

    def write_catalog(self, table: pa.Table, key: str = "catalog/segments.parquet") -> str:
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        return self.storage.write_atomic(key, sink.getvalue())


@contextmanager
def open_runtime(settings: Settings) -> Iterator[VchanRuntime]:
    """Connect to etcd (the embedded one is started/reused when no endpoints are set)."""
    if settings.embedded_etcd:
        etcd = EmbeddedEtcd(settings.etcd_dir).start(detach=True)
        store = MetaStore.connect(settings, endpoints=[etcd.endpoint])
    else:
        store = MetaStore.connect(settings)
    storage = Storage.from_settings(settings)
    try:
        yield VchanRuntime(settings, store, storage)
    finally:
        store.close()
