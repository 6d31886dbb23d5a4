"""A change stream killed mid-batch while everything else goes on: a streaming query into a
Parquet sink runs in its own process (its own Spark driver), following a collection that a
producer thread keeps inserting into and deleting from, that a `vchan datanode` syncs and
that a `vchan datacoord` sorts, compacts and garbage-collects (log retention at 1 s: only
the stream's registration keeps the log it has not committed). The process group is
SIGKILLed while a micro-batch is planned and not committed; the query restarts from its
Spark checkpoint and reads to the end. The sink then holds every change of the log once:
each (vchannel, offset) once, every acknowledged insert and delete, and for the log files
retention kept, exactly their changes."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.config import Settings
from vchan_assets.datacoord.streams import get_stream
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.query.spark_source import spark_session
from vchan_assets.query.view import collection_segments
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import Cluster, Load, Role, all_synced, cli_env, create_collections
from vchan_assets.testing.streams import sink_changes, sink_rows, stream_options
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.format import CorruptLogError
from vchan_assets.wal.reader import WalReader

from .helpers import race_settings

KEY = ["vchannel", "offset"]


def _batches(directory: Path) -> set[int]:
    """The batch ids Spark logged in a checkpoint's `offsets` or `commits` directory."""
    if not directory.exists():
        return set()
    return {int(p.name) for p in directory.iterdir() if p.name.isdigit()}


def mid_batch(checkpoint: Path) -> bool:
    """A batch after the first is planned (in the offsets log) and not committed."""
    committed = _batches(checkpoint / "commits")
    return bool(committed) and bool({b for b in _batches(checkpoint / "offsets") if b > 0} - committed)


def changes_while_retention_runs(storage: Storage, info: CollectionInfo) -> float:
    """How many changes the log holds while the DataCoord's retention removes its files: a
    file it removed between the reader's listing and its read is that race, not damage
    (infinity: read again)."""
    try:
        return log_changes(storage, info).num_rows
    except CorruptLogError as exc:
        if "disappeared" not in exc.reason:
            raise
        return math.inf


def log_changes(storage: Storage, info: CollectionInfo) -> pa.Table:
    """The inserts and deletes of the log files still there (vchannel, offset, op, pk)."""
    tables = []
    for v in info.vchannels:
        t = WalReader(storage, v, info).read(-1)
        t = t.filter(pc.is_in(t["msg_type"], value_set=pa.array(["insert", "delete"])))
        tables.append(
            pa.table(
                {
                    "vchannel": pa.repeat(pa.scalar(v), t.num_rows),
                    "offset": t["offset"],
                    "op": t["msg_type"],
                    "pk": t["pk"],
                }
            )
        )
    return pa.concat_tables(tables).sort_by([(k, "ascending") for k in KEY])


def test_a_stream_killed_mid_batch_while_the_lifecycle_runs_sinks_every_change_once(
    store: MetaStore, settings: Settings, tmp_path: Path
) -> None:
    cluster = Cluster(replace(race_settings(settings), stream_idle_timeout=600.0), tmp_path)
    storage = Storage.from_settings(cluster.settings)
    producer, [info] = create_collections(store, cluster.settings, count=1, shards=2)
    # A round every 0.5 s: the stream's first batch (a cold JVM and Python workers, tens of
    # seconds on a loaded machine) does not pile up thousands of log files for the restart
    # to read; the node still syncs, the coordinator still seals, sorts and collects.
    load = Load(producer, [info], rows=20, period=0.5)
    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"
    options = stream_options(cluster.settings, store, info.name)
    child: subprocess.Popen[bytes] | None = None
    try:
        cluster.node()
        coordinator = ["datacoord", "--interval", "0.2", "--engine", "local"]
        cluster.roles.append(Role(coordinator, cluster.env(), tmp_path / "datacoord.log"))
        with open(tmp_path / "stream.log", "wb") as out:
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vchan_assets.testing.streams",
                    info.name,
                    str(sink),
                    str(checkpoint),
                    "--every=0.3",
                    "maxRowsPerTrigger=100",
                ],
                env=cli_env(cluster.settings),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the driver, its JVM and Spark's Python workers: one group
            )
        # The stream follows the collection from its first change: it registers (and so holds
        # log retention) before anything is written.
        wait_until(
            lambda: get_stream(store, options["streamId"]) or child.poll() is not None,
            300,
            "the stream registered",
        )
        load.start()
        wait_until(
            lambda: mid_batch(checkpoint) or child.poll() is not None,
            300,
            "a planned, uncommitted batch",
            0.01,
        )
        assert child.poll() is None, (tmp_path / "stream.log").read_text()[-3000:]
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        child = None
        killed_at = max(_batches(checkpoint / "offsets"))
        load.stop()
        producer.flush(info.name)
        producer.time_tick(info.name)
        wait_until(lambda: all_synced(store, storage, [info]), 300, "every change synced", 0.2)

        spark: Any = spark_session(System(cluster.settings, store, storage))
        sink_changes(spark, options, str(sink), str(checkpoint))
        got = sink_rows(spark, str(sink)).select([*KEY, "op", "pk"]).sort_by([(k, "ascending") for k in KEY])
        segments = collection_segments(store, info.id)
        # The race the test is about includes retention removing log files the stream had
        # committed: the DataCoord's GC does it on its own schedule, so wait for it (a run
        # that looked before it came failed `kept < got` with every change sunk right).
        wait_until(
            lambda: changes_while_retention_runs(storage, info) < got.num_rows,
            120,
            "retention to remove log files the stream committed",
            0.5,
            describe=lambda: (
                f"{changes_while_retention_runs(storage, info)} changes still in the log of {got.num_rows}"
            ),
        )
    finally:
        if child is not None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        load.stop()
        cluster.cleanup()

    # Each change once.
    keys = _keys(got)
    assert pc.count_distinct(keys).as_py() == got.num_rows, "a change sunk twice"
    # Every acknowledged insert and delete.
    produced = load.produced[info.name]
    inserted = got.filter(pc.equal(got["op"], "insert"))["pk"].to_pylist()
    deleted = got.filter(pc.equal(got["op"], "delete"))["pk"].to_pylist()
    assert sorted(inserted) == sorted(produced.table["pk"].to_pylist())
    assert sorted(deleted) == sorted(produced.deleted)
    # What the log still holds, the sink holds at the same offsets.
    kept = log_changes(storage, info)
    retained = got.filter(pc.is_in(keys, value_set=_keys(kept)))
    assert retained.equals(kept)
    # The race was run: the kill came after a committed batch, retention removed log files
    # the stream had committed, the lifecycle sorted segments.
    assert killed_at >= 1
    assert kept.num_rows < got.num_rows
    assert any(s.is_sorted for s in segments)


def _keys(t: pa.Table) -> pa.Array:
    return pc.binary_join_element_wise(t["vchannel"], pc.cast(t["offset"], pa.string()), ":")
