"""The sync task: exactly-once persistence of vchannels into binlogs (invariants 1-4 and 6 of docs/architecture.md).

Real etcd, real Spark (local[2]), real files; crashes are SIGKILLs of a real
`vchan sync` process at a named commit step.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datacoord.recovery import RecoverySnapshot, list_orphans, recovery_info
from vchan_assets.datanode.stats import PkStats
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.errors import LeaseLostError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, RecoveryInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, VCHAN, Produced, cli_env, produce, read_inserted, segments
from vchan_assets.testing.steps import assert_exactly_once, sync_all
from vchan_assets.wal.format import (
    CorruptLogError,
    SchemaMismatchError,
    UnknownMessageTypeError,
    log_schema,
    wal_key,
)
from vchan_assets.wal.producer import Producer
from vchan_assets.wal.reader import WalReader

from .helpers import checkpoint, meta_state, run_sync_process, sync_stopped_at


def _meta_versions(store: MetaStore) -> dict[str, int]:
    """Mod revision of every key under this test's root. Not etcd's global revision: the
    etcd is shared by the whole run, and other tests' session leases expire on it."""
    return {kv.key: kv.mod_revision for kv in store.list_prefix(store.keys.root + "/").items}


def _ids(store: MetaStore) -> IdAllocator:
    return IdAllocator(store)


# --- the happy path -----------------------------------------------------------------------


def test_binlogs_read_back_with_pyarrow_equal_the_rows_produced(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 3000, start_pk=0, deletes=40)
    produce(producer, collection.name, produced, 2000, start_pk=10_000)
    sync_all(system, collection, engine="spark")
    assert_exactly_once(store, storage, collection, produced)
    for vchannel in collection.vchannels:
        assert checkpoint(store, vchannel) == WalReader(storage, vchannel, collection).head()


def test_flush_marks_segments_flushed_once_checkpoints_pass_the_flush_ts(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 1000, start_pk=0)
    flush_ts = producer.flush(collection.name)
    assert not producer.flush_state(collection.name, flush_ts)
    sync_all(system, collection, engine="spark")
    assert producer.flush_state(collection.name, flush_ts)
    l1 = [s for s in segments(store, collection) if s.level is SegmentLevel.L1]
    assert l1 and all(s.state is SegmentState.FLUSHED for s in l1)
    assert sum(s.num_rows for s in l1) == 1000


def test_second_sync_appends_new_rows_and_a_sync_with_nothing_new_is_a_no_op(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 500, start_pk=0)
    sync_all(system, collection, engine="spark")
    first = {v: checkpoint(store, v) for v in collection.vchannels}
    produce(producer, collection.name, produced, 500, start_pk=1000, deletes=10)
    sync_all(system, collection, engine="spark")
    for v in collection.vchannels:
        after = checkpoint(store, v)
        assert after is not None and first[v] is not None and after.offset > first[v].offset  # type: ignore[union-attr]
    before = meta_state(store)
    vchannel = collection.vchannels[0]
    lease = store.read_lease(vchannel)
    assert lease is not None
    result = SyncTask(system, collection, vchannel, lease, engine="spark").run()
    assert result.skipped and meta_state(store) == before
    assert_exactly_once(store, storage, collection, produced)


def test_stats_logs_hold_pk_range_and_a_bloom_filter_of_their_binlog(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 2000, start_pk=100)
    sync_all(system, collection, engine="spark")
    for seg in segments(store, collection):
        if seg.level is SegmentLevel.L0:
            continue
        pks = np.concatenate(
            [pq.read_table(storage.path(b.path))["pk"].to_numpy() for b in seg.binlogs[0].logs]
        )
        stats = [PkStats.from_bytes(storage.read_bytes(s.path)) for s in seg.statslogs]
        assert min(s.pk_min for s in stats) == pks.min() and max(s.pk_max for s in stats) == pks.max()
        assert np.logical_or.reduce([s.might_contain(pks) for s in stats]).all()
        absent = np.arange(10**9, 10**9 + 10_000)
        assert not np.logical_or.reduce([s.might_contain(absent) for s in stats]).any()


def test_recovery_info_lists_seek_position_and_segments_by_state(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 600, start_pk=0)
    vchannel = collection.vchannels[0]
    before = recovery_info(store, collection, vchannel)
    assert before.seek_position is not None and before.seek_position.offset == 0  # create_collection message
    assert before.unflushed_segment_ids and not before.flushed_segment_ids
    producer.flush(collection.name)
    sync_all(system, collection, engine="spark")
    after = recovery_info(store, collection, vchannel)
    assert after.seek_position == checkpoint(store, vchannel)
    assert set(before.unflushed_segment_ids) <= set(after.flushed_segment_ids)
    assert not after.unflushed_segment_ids


def test_a_recovery_snapshot_gives_every_channel_what_recovery_info_reads_for_it(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    """The coordinator's per-step snapshot (one read of the checkpoints, one of each
    collection's segments) gives each channel its own seek position and segments."""

    def both() -> tuple[list[RecoveryInfo], list[RecoveryInfo]]:
        snapshot = RecoverySnapshot(store)
        channels = collection.vchannels
        return [snapshot.recovery_info(collection, v) for v in channels], [
            recovery_info(store, collection, v) for v in channels
        ]

    produce(producer, collection.name, Produced(), 600, start_pk=0)
    from_snapshot, read = both()
    assert from_snapshot == read and all(r.unflushed_segment_ids for r in read)
    producer.flush(collection.name)
    sync_all(system, collection, engine="spark")
    from_snapshot, read = both()
    assert from_snapshot == read
    assert [r.seek_position for r in read] == [checkpoint(store, v) for v in collection.vchannels]
    assert len({r.seek_position for r in read}) == len(read) > 1  # per channel, not one for all


# --- segment meta size ------------------------------------------------------------------

SMALL_REQUEST_BYTES = 16 * 1024  # etcd's --max-request-bytes: ~35 syncs of one segment's meta


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd that refuses requests over SMALL_REQUEST_BYTES, to reach the limit in seconds."""
    server = EmbeddedEtcd(tmp_path / "small-etcd", max_request_bytes=SMALL_REQUEST_BYTES).start()
    yield server
    server.stop()


def test_growing_segment_is_sealed_by_binlog_file_count_before_its_meta_outgrows_etcd_request_limit(
    settings: Settings, small_etcd: EmbeddedEtcd, storage: Storage
) -> None:
    settings = replace(settings, etcd_endpoints=(small_etcd.endpoint,), segment_max_binlog_files=8)
    store = MetaStore.connect(settings)
    try:
        producer = Producer(System(settings, store, storage))
        info = producer.create_collection("small", SCHEMA, num_channels=1)
        vchannel = info.vchannels[0]
        lease = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
        produced = Produced()
        for i in range(60):  # one segment would pass the limit after ~35 syncs
            produce(producer, info.name, produced, 10, start_pk=i * 10)
            SyncTask(System(settings, store, storage), info, vchannel, lease, engine="local").run()
        assert_exactly_once(store, storage, info, produced)
        l1 = [s for s in segments(store, info) if s.level is SegmentLevel.L1]
        assert len(l1) >= 60 // 9
        # sealed at 8 files; the sync that flushes it adds the last rows assigned before the seal
        assert max(len(s.binlogs[0].logs) for s in l1) <= 8 + 1
    finally:
        store.close()


# --- crashes between commit steps -------------------------------------------------------


@pytest.mark.parametrize("step", ["after_binlogs", "after_segment_meta", "before_checkpoint"])
def test_sync_killed_at_a_commit_step_then_resynced_persists_every_row_exactly_once(
    system: System, step: str, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 2000, start_pk=0, deletes=30)
    sync_all(system, collection, engine="spark")  # a first committed sync
    produce(producer, collection.name, produced, 2000, start_pk=5000, deletes=25)
    vchannel = collection.vchannels[0]
    lease = store.read_lease(vchannel)
    assert lease is not None
    cp_before = checkpoint(store, vchannel)
    meta_before = {s.id: s for s in segments(store, collection)}

    # The commit steps run in the driver, the same for both engines: the process that dies
    # writes its binlogs with Spark where the files are what the step leaves behind, and
    # in process (no JVM to start) past the meta commit.
    engine = "spark" if step == "after_binlogs" else "local"
    crashed = run_sync_process(
        system.settings, collection.name, vchannel, lease.lease_id, engine, VCHAN_FAILPOINT=step
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]

    assert checkpoint(store, vchannel) == cp_before, "the checkpoint moved although the sync died"
    orphans = list_orphans(store, system.storage)
    if step == "after_binlogs":
        assert orphans, "the files of a sync killed before its meta commit must be listed as orphans"
        assert {s.id: s for s in segments(store, collection)} == meta_before, "meta changed before its commit"
    else:
        assert not orphans

    sync_all(system, collection, engine="spark")  # a new sync replays from the old checkpoint
    cp_after = checkpoint(store, vchannel)
    assert cp_before is not None and cp_after is not None and cp_after.offset > cp_before.offset
    assert_exactly_once(store, system.storage, collection, produced)


def test_lease_revoked_between_binlog_write_and_meta_commit_rejects_the_commit(
    tmp_path: Path,
    store: MetaStore,
    storage: Storage,
    settings: Settings,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    produce(producer, collection.name, Produced(), 1000, start_pk=0)
    vchannel = collection.vchannels[0]
    old = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    child = sync_stopped_at(settings, collection.name, vchannel, old.lease_id, "after_binlogs", tmp_path)
    new = grant_channel_lease(store, _ids(store), vchannel, node_id=2)  # the channel moved to node 2
    before = _meta_versions(store)
    child.send_signal(signal.SIGCONT)
    _, stderr = child.communicate(timeout=60)

    assert child.returncode == 3, stderr
    assert f"lease {old.lease_id} was revoked or replaced (lease {new.lease_id} holds it now)" in stderr
    assert _meta_versions(store) == before, "the fenced-off writer changed meta"
    assert checkpoint(store, vchannel) is None
    assert all(not s.binlogs for s in segments(store, collection))
    assert list_orphans(store, storage), "the rejected sync's files are orphans"


def test_vchan_sync_take_lease_fences_the_old_writer_and_syncs_every_channel_under_its_new_lease(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 1000, start_pk=0)
    old = {v: grant_channel_lease(store, _ids(store), v, node_id=1) for v in collection.vchannels}
    args = [str(VCHAN), "sync", "--collection", collection.name, "--take-lease", "--engine", "local"]
    done = subprocess.run(args, env=cli_env(settings), capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-2000:]
    for vchannel in collection.vchannels:
        lease = store.read_lease(vchannel)
        assert lease is not None and lease.lease_id != old[vchannel].lease_id and lease.node_id == 0
        assert checkpoint(store, vchannel) == WalReader(storage, vchannel, collection).head()
    # Each channel's line says where its binlogs were written and where its seconds went.
    lines = [line for line in done.stdout.splitlines() if "rows" in line]
    assert len(lines) == len(collection.vchannels), done.stdout
    assert all(
        re.search(r"\(DataNode process; state [\d.]+s, binlogs [\d.]+s, commit [\d.]+s\)$", line)
        for line in lines
    ), lines


@pytest.mark.parametrize("step", ["after_binlogs", "after_segment_meta"])
def test_two_syncs_of_one_channel_under_one_lease_commit_its_rows_once(
    system: System, step: str, tmp_path: Path, producer: Producer, collection: CollectionInfo
) -> None:
    """Two syncs of one vchannel under the same lease at once (a Dagster run the run
    monitor gave up on while its worker still ran, and the sensor's next run): the one
    that read the channel first and commits last must not append its rows and deletes a
    second time. The first sync stops after writing its binlogs (or after its segment
    meta); the second runs through; the first then finds the channel claimed by another
    sync and commits nothing more."""
    produced = Produced()
    produce(producer, collection.name, produced, 1000, start_pk=0, deletes=50)
    vchannel = collection.vchannels[0]
    lease = grant_channel_lease(system.store, _ids(system.store), vchannel, node_id=1)
    first = sync_stopped_at(system.settings, collection.name, vchannel, lease.lease_id, step, tmp_path)
    second = SyncTask(system, collection, vchannel, lease, engine="local").run()
    if step == "after_binlogs":
        assert second.rows > 0 and second.deletes > 0
    first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=60)

    sync_all(system, collection)
    assert_exactly_once(system.store, system.storage, collection, produced)
    assert first.returncode != 0, "the stale sync committed"
    assert "another sync of" in stderr, stderr


def test_sync_with_a_lease_that_is_not_current_writes_nothing(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 100, start_pk=0)
    vchannel = collection.vchannels[0]
    stale = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    grant_channel_lease(store, _ids(store), vchannel, node_id=2)
    with pytest.raises(LeaseLostError) as err:
        SyncTask(system, collection, vchannel, stale, engine="local").run()
    assert err.value.channel == vchannel and err.value.expected == stale.lease_id
    assert checkpoint(store, vchannel) is None


# --- bad input ----------------------------------------------------------------------------


def _last_file_key(storage: Storage, collection: CollectionInfo, vchannel: str) -> str:
    return WalReader(storage, vchannel, collection).files()[-1].key


def test_truncated_log_file_gives_corrupt_log_error_and_checkpoint_unchanged(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 500, start_pk=0)
    vchannel = collection.vchannels[0]
    reader = WalReader(storage, vchannel, collection)
    victim = reader.files()[1].key  # the insert batch (0 is create_collection)
    path = Path(storage.path(victim))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    lease = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    with pytest.raises(CorruptLogError) as err:
        SyncTask(system, collection, vchannel, lease, engine="spark").run()
    assert err.value.path == storage.path(victim)
    assert checkpoint(store, vchannel) is None


def test_a_damaged_file_below_the_checkpoint_does_not_stop_the_channel(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 100, start_pk=0)
    vchannel = collection.vchannels[0]
    lease = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    SyncTask(system, collection, vchannel, lease, engine="local").run()
    synced = WalReader(storage, vchannel, collection).files()[1].key  # the insert batch
    Path(storage.path(synced)).write_bytes(b"damaged after it was synced")
    produce(producer, collection.name, Produced(), 100, start_pk=100)

    result = SyncTask(system, collection, vchannel, lease, engine="local").run()

    assert result.synced and result.rows > 0
    assert checkpoint(store, vchannel) == result.end


def _append_raw(storage: Storage, collection: CollectionInfo, vchannel: str, table: pa.Table) -> None:
    """Write a log file by hand (as a buggy or foreign producer would)."""
    reader = WalReader(storage, vchannel, collection)
    first = reader.end_offset()
    table = table.set_column(0, "offset", pa.array(range(first, first + table.num_rows), pa.int64()))
    last_ts = max(table["timestamp"].to_pylist())
    meta = {
        b"vchan.channel": vchannel.encode(),
        b"vchan.collection_id": str(collection.id).encode(),
        b"vchan.first_offset": str(first).encode(),
        b"vchan.count": str(table.num_rows).encode(),
        b"vchan.last_timestamp": str(last_ts).encode(),
    }
    table = table.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    storage.write_atomic(wal_key(vchannel, first), sink.getvalue())


def _tick_rows(collection: CollectionInfo, msg_type: str, ts: int, n: int = 1) -> pa.Table:
    schema = log_schema(collection.schema)
    columns = {f.name: pa.nulls(n, f.type) for f in schema}
    columns["offset"] = pa.array([0] * n, pa.int64())
    columns["msg_type"] = pa.array([msg_type] * n, pa.string())
    columns["timestamp"] = pa.array([ts] * n, pa.int64())
    return pa.table(columns, schema=schema)


def test_unknown_message_type_gives_a_clear_error_and_checkpoint_unchanged(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 200, start_pk=0)
    vchannel = collection.vchannels[0]
    head = WalReader(storage, vchannel, collection).head()
    assert head is not None
    bad = pa.concat_tables(
        [
            _tick_rows(collection, "bogus", head.timestamp + 1),
            _tick_rows(collection, "timetick", head.timestamp + 2),
        ]
    )
    _append_raw(storage, collection, vchannel, bad)
    lease = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    with pytest.raises(UnknownMessageTypeError) as err:
        SyncTask(system, collection, vchannel, lease, engine="spark").run()
    assert err.value.msg_type == "bogus"
    assert checkpoint(store, vchannel) is None


def test_log_file_with_another_schema_gives_schema_mismatch_and_checkpoint_unchanged(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 200, start_pk=0)
    vchannel = collection.vchannels[0]
    head = WalReader(storage, vchannel, collection).head()
    assert head is not None
    wrong = _tick_rows(collection, "timetick", head.timestamp + 1).drop_columns(["s"])
    _append_raw(storage, collection, vchannel, wrong)
    lease = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    with pytest.raises(SchemaMismatchError, match="missing \\['s'\\]"):
        SyncTask(system, collection, vchannel, lease, engine="spark").run()
    assert checkpoint(store, vchannel) is None


def test_channel_without_any_log_sync_is_a_clean_no_op(
    system: System, store: MetaStore, storage: Storage, collection: CollectionInfo
) -> None:
    vchannel = collection.vchannels[1]
    storage.filesystem.delete_dir(storage.path(f"wal/{vchannel}"))  # as a channel nobody wrote to
    lease = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    before = meta_state(store)
    result = SyncTask(system, collection, vchannel, lease, engine="spark").run()
    assert result.skipped and result.rows == 0
    assert meta_state(store) == before and checkpoint(store, vchannel) is None


def test_channel_with_only_ddl_and_time_ticks_advances_checkpoint_without_files(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    producer.time_tick(collection.name)
    vchannel = collection.vchannels[1]
    lease = grant_channel_lease(store, _ids(store), vchannel, node_id=1)
    result = SyncTask(system, collection, vchannel, lease, engine="spark").run()
    assert result.rows == 0 and result.files == 0
    assert checkpoint(store, vchannel) == WalReader(storage, vchannel, collection).head()
    assert not list_orphans(store, storage) and read_inserted(store, storage, collection).num_rows == 0


def test_replay_leaves_out_the_rows_of_dropped_segments(
    system: System, store: MetaStore, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    """Replay filters by segment state, not only by offset (as Milvus' flowgraph drops the
    inserts of flushed and dropped segments): rows of a segment the coordinator dropped
    while they were still unsynced in the log are not written, and the Dropped segment's
    meta gains no binlogs."""
    from vchan_assets.datacoord.segment_manager import SegmentManager

    produce(producer, collection.name, Produced(), 200, start_pk=0)
    dropped = SegmentManager(store, system.settings).drop_partition(collection.id, collection.partitions[0])
    assert dropped

    sync_all(system, collection)

    by_id = {s.id: s for s in segments(store, collection)}
    for sid in dropped:
        assert by_id[sid].state is SegmentState.DROPPED
        assert by_id[sid].binlog_files == [] and by_id[sid].num_rows == 0, f"segment {sid} got rows"
    assert not [k for k in storage.list_keys("insert_log/") if f"/{dropped[0]}/" in k]
    for vchannel in collection.vchannels:
        assert checkpoint(store, vchannel) == WalReader(storage, vchannel, collection).head()


# --- where the tasks run ------------------------------------------------------------------


def _spark_jobs_started() -> int:
    """Jobs the process's Spark session has started so far (its scheduler's job counter)."""
    from vchan_assets.spark.session import get_spark

    sc = get_spark(Settings()).sparkContext
    return int(sc._jsc.sc().dagScheduler().numTotalJobs())


def test_a_small_sync_skips_the_spark_job_and_a_larger_one_runs_it(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 2000, start_pk=0, deletes=20)
    small, large = collection.vchannels
    log_mb = {
        v: sum(f.size_bytes for f in WalReader(storage, v, collection).files()) / 2**20
        for v in (small, large)
    }
    ids = _ids(store)
    results = {}
    for vchannel, limit in ((small, log_mb[small] * 2), (large, log_mb[large] / 2)):
        lease = grant_channel_lease(store, ids, vchannel, node_id=1)
        task_settings = replace(settings, sync_in_process_mb=limit)
        jobs = _spark_jobs_started()
        result = SyncTask(
            System(task_settings, store, storage), collection, vchannel, lease, engine="spark"
        ).run()
        results[vchannel] = (result.in_process, _spark_jobs_started() - jobs, result.written_by)
        # The sync says where its time went, whichever way it wrote.
        assert result.phases is not None and min(asdict(result.phases).values()) >= 0
        assert sum(asdict(result.phases).values()) == pytest.approx(result.seconds)
    assert results == {small: (True, 0, "DataNode process"), large: (False, 1, "Spark job")}
    assert_exactly_once(store, storage, collection, produced)


def test_vchan_sync_of_a_collection_syncs_every_healthy_channel_and_exits_5_naming_the_damaged_one(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 500, start_pk=0)
    damaged, healthy = collection.vchannels
    victim = WalReader(storage, damaged, collection).files()[1].key
    path = Path(storage.path(victim))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    args = [str(VCHAN), "sync", "--collection", collection.name, "--take-lease", "--engine", "local"]

    done = subprocess.run(args, env=cli_env(settings), capture_output=True, text=True, timeout=300)

    assert done.returncode == 5, done.stderr[-2000:]
    assert f"damaged, not synced: {damaged}" in done.stderr and str(path) in done.stderr
    assert checkpoint(store, damaged) is None
    assert checkpoint(store, healthy) == WalReader(storage, healthy, collection).head()
