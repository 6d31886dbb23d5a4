"""Steps the tests share, in-process on real etcd and real files: a new collection, a sync
of every vchannel (the DataNode's sync task), a manual mix compaction of a collection (the
DataCoord's compaction trigger and executor), a GC pass past the log retention, flushed
rounds of known rows, the lifecycle's invariants read back through the catalog, the
per-vchannel segment index against segment meta, what an action read of etcd, `vchan`
processes.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Literal

import pyarrow as pa

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.codec import encode
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore, Value
from vchan_assets.model import (
    Binlog,
    CollectionInfo,
    CollectionSchema,
    ColumnGroupBinlogs,
    MsgPosition,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
)
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    SCHEMA,
    VCHAN,
    Cluster,
    Load,
    Produced,
    all_synced,
    cli_env,
    exactly_once,
    produce,
    segments,
)
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer


def new_collection(
    producer: Producer, channels: int = 2, schema: CollectionSchema = SCHEMA, prefix: str = "c"
) -> CollectionInfo:
    """A collection of a new name (`prefix` and 8 hex digits) with `channels` vchannels."""
    return producer.create_collection(f"{prefix}{uuid.uuid4().hex[:8]}", schema, num_channels=channels)


def sync_all(system: System, info: CollectionInfo, *, engine: Literal["local", "spark"] = "local") -> None:
    """One sync task of every vchannel of `info`, under the channel's current lease (one
    granted to node 1 where the channel has none)."""
    store = system.store
    for vchannel in info.vchannels:
        lease = store.read_lease(vchannel) or grant_channel_lease(
            store, IdAllocator(store), vchannel, node_id=1
        )
        SyncTask(system, info, vchannel, lease, engine=engine).run()


def compact_all(system: System, info: CollectionInfo) -> None:
    """A manual mix compaction of `info`, planned and run here; every plan must complete."""
    CompactionTrigger(system).trigger(info, CompactionType.MIX, manual=True)
    outcomes = CompactionExecutor(system, "local").run_pending()
    assert all(o.state is PlanState.COMPLETED for o in outcomes), outcomes


def retain(system: System, later: float = 10.0, expect_deletes: bool = True) -> list[str]:
    """One GC pass `later` seconds from now, past a log retention of 5 s: the log files it
    deleted (with `expect_deletes`, at least one, or the calling test proves nothing)."""
    quick = replace(system, settings=replace(system.settings, wal_retention=5.0))
    deleted = GarbageCollector(quick, clock=lambda: time.time() + later).run().wal_files
    assert deleted or not expect_deletes, "nothing was old enough to delete: the test proves nothing"
    return deleted


def flushed_batches(
    system: System,
    producer: Producer,
    info: CollectionInfo,
    batches: int,
    rows: int = 200,
    deletes: int = 10,
    first_batch: int = 0,
) -> Produced:
    """`batches` rounds of insert (+ deletes of the round's first pks), flush, sync: one
    small Flushed L1 segment per round and vchannel, one L0 segment per round."""
    produced = Produced()
    for b in range(first_batch, first_batch + batches):
        produce(producer, info.name, produced, rows, start_pk=b * 10_000, deletes=deletes)
        producer.flush(info.name)
        sync_all(system, info)
    return produced


def flushed_segment(info: CollectionInfo, vchannel: str, segment_id: int) -> SegmentInfo:
    """The meta of a Flushed, sorted segment of 4 binlogs and 4 stats logs (about 1.9 KB),
    as a sync and a sort leave it (its files are not written: for tests of meta alone)."""
    ts = 449_000_000_000_000_000

    def log(n: int) -> Binlog:
        log_id = segment_id * 100 + n
        path = f"insert_log/{info.id}/{info.partitions[0]}/{segment_id}/0/{log_id}.parquet"
        return Binlog(log_id, path, entries=1000, ts_from=ts + n, ts_to=ts + 100_000 + n, size_bytes=123_456)

    fields = (0, 1, *(f.field_id for f in info.schema.fields))
    return SegmentInfo(
        id=segment_id,
        collection_id=info.id,
        partition_id=info.partitions[0],
        vchannel=vchannel,
        state=SegmentState.FLUSHED,
        level=SegmentLevel.L1,
        num_rows=4000,
        max_rows=100_000,
        binlogs=(ColumnGroupBinlogs(0, fields, tuple(log(n) for n in range(4))),),
        statslogs=tuple(log(50 + n) for n in range(4)),
        start_position=MsgPosition(vchannel, 0, ts),
        dml_position=MsgPosition(vchannel, 4000, ts),
        is_sorted=True,
        last_flush_ts=ts,
        created_at=1.7e9,
        last_insert_at=1.7e9,
        seal_ts=ts,
        flushed_at=1.7e9,
    )


def write_segments(
    store: MetaStore,
    info: CollectionInfo,
    vchannel: str,
    count: int,
    first: int = 10_000_000,
    indexed: bool = True,
    batch: int = 60,
) -> int:
    """`count` flushed segments of `info` on `vchannel` (ids from `first`), written straight
    to etcd, `batch` segments a transaction; returns the bytes of segment meta written.
    `indexed`: each with its vchannel's index entry, as segments are created now; else its
    key alone, as a version before the index wrote them."""
    door = SegmentMeta(store)
    written = 0
    for start in range(first, first + count, batch):
        made = [flushed_segment(info, vchannel, i) for i in range(start, min(start + batch, first + count))]
        puts: dict[str, Value] = {}
        for seg in made:
            puts.update(door.create_puts(seg) if indexed else {door.key(seg): seg})
        assert store.txn({}, puts) is not None
        written += sum(len(encode(seg)) for seg in made)
    return written


def reads(store: MetaStore, action: Callable[[], object]) -> tuple[int, int]:
    """(keys, bytes) etcd returned to `store` while `action` ran (`MetaStore.keys_read`)."""
    keys, size = store.keys_read, store.bytes_read
    action()
    return store.keys_read - keys, store.bytes_read - size


def requests(store: MetaStore, action: Callable[[], object]) -> list[str]:
    """The requests `store` sent to etcd while `action` ran, each named by its operation
    (every request goes through `MetaStore._call`)."""
    sent: list[str] = []
    call = store._call

    def counted(operation: str) -> AbstractContextManager[None]:
        sent.append(operation)
        return call(operation)

    store._call = counted  # type: ignore[method-assign,assignment]
    try:
        action()
    finally:
        del store._call  # the class's method again
    return sent


def live(store: MetaStore, info: CollectionInfo) -> list[SegmentInfo]:
    """The segments of `info` not Dropped."""
    return [s for s in segments(store, info) if s.state is not SegmentState.DROPPED]


def live_l1(store: MetaStore, info: CollectionInfo) -> list[SegmentInfo]:
    """The live segments of `info` that hold rows (not L0)."""
    return [s for s in live(store, info) if s.level is not SegmentLevel.L0]


def expected_pks(produced: Produced) -> list[int]:
    """The produced pks not deleted, sorted."""
    deleted = set(produced.deleted)
    return sorted(pk for pk in produced.table["pk"].to_pylist() if pk not in deleted)


def assert_exactly_once(store: MetaStore, storage: Storage, info: CollectionInfo, produced: Produced) -> None:
    """Every produced row in exactly one binlog with its values; every delete in a delta log once."""
    tally = exactly_once(store, storage, info, produced)
    assert tally.ok, tally.describe()
    assert_channel_index_complete(store)


def assert_channel_index_complete(store: MetaStore) -> None:
    """Every segment key has its entry in its vchannel's index and every entry a segment
    key, both read at one revision: no site that creates or deletes a segment forgot it."""
    door = SegmentMeta(store)
    segments, entries = store.list_prefixes([door.prefix(), store.keys.channel_segment.prefix])
    want = {door.index_key(d.model) for d in store.decode_models(segments, SegmentInfo, skip_malformed=True)}
    have = {kv.key for kv in entries}
    assert not want - have, f"segments without their vchannel's index entry: {sorted(want - have)[:5]}"
    assert not have - want, f"index entries without their segment: {sorted(have - want)[:5]}"


def assert_lifecycle_invariants(system: System, info: CollectionInfo, produced: Produced) -> None:
    """Every live row in exactly one live segment, every delete applied, no live meta
    naming a missing file."""
    rows = Catalog(system).read_collection(info.name, as_arrow=True)
    assert isinstance(rows, pa.Table)
    counts = Counter(rows["pk"].to_pylist())
    dup = [pk for pk, c in counts.items() if c > 1]
    assert not dup, f"pks in more than one live segment: {dup[:5]}"
    assert sorted(counts) == expected_pks(produced)
    want = produced.table.sort_by("pk")
    got = rows.sort_by("pk")
    keep = pa.array([pk in counts for pk in want["pk"].to_pylist()])
    for column in ("n", "s", "vec"):
        assert got[column].equals(want.filter(keep)[column]), f"column {column} changed"
    missing = [p for s in live(system.store, info) for p in s.file_paths if not system.storage.exists(p)]
    assert not missing, f"live meta names missing files: {missing[:3]}"
    assert_channel_index_complete(system.store)


def write_twice(store: MetaStore, seg: SegmentInfo) -> SegmentInfo:
    """A second meta of `seg` under another id, naming the same binlogs: its rows live twice."""
    copy = seg.with_changes(id=seg.id + 1_000_000)
    SegmentMeta(store).create(copy)
    return copy


def drop_without_copy(store: MetaStore, seg: SegmentInfo) -> None:
    """`seg` Dropped with nothing compacted from it: its rows (or deletes) are gone."""
    door = SegmentMeta(store)
    found = door.get(seg.collection_id, seg.partition_id, seg.id)
    assert found is not None
    door.swap(found.kv.version, found.model.with_changes(state=SegmentState.DROPPED, dropped_at=1.0))


def run_vchan(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`vchan ARGS` in its own process on `settings` and the variables `env`, to its end."""
    return subprocess.run(
        [str(VCHAN), *args], env=cli_env(settings, **env), capture_output=True, text=True, timeout=300
    )


def start_datacoord(settings: Settings, engine: str = "local", **env: str) -> subprocess.Popen[bytes]:
    """A `vchan datacoord --engine {engine}` process on `settings` and the variables `env`,
    its output piped (read it with `communicate` after `terminate`)."""
    return subprocess.Popen(
        [str(VCHAN), "datacoord", "--engine", engine],
        env=cli_env(settings, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish_and_check(cluster: Cluster, store: MetaStore, producer_infos: tuple, load: Load) -> None:
    """Stop the load, let the nodes sync everything, then check exactly-once."""
    producer, infos = producer_infos
    load.stop()
    for info in infos:
        producer.time_tick(info.name)
    storage = Storage.from_settings(cluster.settings)
    wait_until(lambda: all_synced(store, storage, infos), 40, "every channel synced to its head")
    for info in infos:
        assert_exactly_once(store, storage, info, load.produced[info.name])
    assert_channel_index_complete(store)
