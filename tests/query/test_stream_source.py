"""`spark.readStream.format("vchan")`: every insert and delete of a collection's log,
once, in offset order per vchannel, from where it starts up to the checkpoint or the head;
registered streams hold back log retention until idle. Real etcd, real log files, a real
local Spark streaming query into a Parquet sink; the planning rules are also driven
through the stream reader directly (as Spark's planner worker calls it), without Spark's
minutes of micro-batch overhead."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from rich.console import Console

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionNotFoundError
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.datacoord.streams import get_stream, list_streams, retention_holds
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.query.asof import iso
from vchan_assets.query.source_options import ReadOptionError
from vchan_assets.query.spark_source import spark_session
from vchan_assets.query.stream_source import (
    StreamCollectionDroppedError,
    StreamOffsetError,
    StreamOffsetRemovedError,
    VchanStreamReader,
)
from vchan_assets.status import collect_status, render_status
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, cli_env
from vchan_assets.testing.steps import retain, sync_all
from vchan_assets.testing.streams import sink_changes, sink_rows, stream_options
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader

KEY = ["vchannel", "offset"]


@dataclass
class Streamed:
    """A collection of 2 vchannels to stream, and what it is stored on."""

    system: System
    producer: Producer
    info: CollectionInfo

    @property
    def settings(self) -> Settings:
        return self.system.settings

    @property
    def store(self) -> MetaStore:
        return self.system.store

    @property
    def storage(self) -> Storage:
        return self.system.storage

    def write(self, start_pk: int, n: int = 300, deletes: int = 30) -> None:
        """`n` inserts from `start_pk`, then deletes of the first `deletes` of them."""
        self.producer.insert(self.info.name, generate_rows(SCHEMA, n, start_pk=start_pk, seed=start_pk))
        if deletes:
            self.producer.delete(
                self.info.name, list(range(start_pk, start_pk + deletes)), partition="_default"
            )

    def persist(self) -> None:
        """Flush and sync: the channel checkpoints move to the log's end."""
        self.producer.flush(self.info.name)
        sync_all(self.system, self.info)

    def options(self, **extra: str) -> dict[str, str]:
        return {**stream_options(self.settings, self.store, self.info.name), **extra}

    def reader(self, **extra: str) -> VchanStreamReader:
        """The stream reader Spark's planner would make of these options."""
        return VchanStreamReader(self.options(**extra))

    def changes(self, up_to: dict[str, int] | None = None, after: dict[str, int] | None = None) -> pa.Table:
        """The inserts and deletes of the log itself (op, ts, vchannel, offset, pk), sorted."""
        tables = []
        for v in self.info.vchannels:
            t = self.log(v).read((after or {}).get(v, -1), (up_to or {}).get(v))
            t = t.filter(pc.is_in(t["msg_type"], value_set=pa.array(["insert", "delete"])))
            vchannel = pa.array([v] * t.num_rows, pa.string())
            tables.append(
                pa.table(
                    {
                        "op": t["msg_type"],
                        "ts": t["timestamp"],
                        "vchannel": vchannel,
                        "offset": t["offset"],
                        "pk": t["pk"],
                    }
                )
            )
        return pa.concat_tables(tables).sort_by([(k, "ascending") for k in KEY])

    def first_batch(self, reader: VchanStreamReader) -> tuple[dict[str, int], dict[str, int]]:
        """Where the reader starts and where its first batch ends (as Spark plans it)."""
        start = reader.initialOffset()
        return start, reader.latestOffset(start, reader.getDefaultReadLimit())

    def log(self, vchannel: str) -> WalReader:
        return WalReader(self.storage, vchannel, self.info)

    def checkpoints(self) -> dict[str, int]:
        found = {v: channel_checkpoint(self.store, v) for v in self.info.vchannels}
        return {v: -1 if cp is None else cp.model.offset for v, cp in found.items()}


@pytest.fixture
def log(system: System, producer: Producer, collection: CollectionInfo) -> Streamed:
    return Streamed(system, producer, collection)


def batch(reader: VchanStreamReader, start: dict[str, int], end: dict[str, int]) -> pa.Table:
    """A micro-batch as Spark runs it: partitions planned, each read (in a task)."""
    parts = reader.partitions(start, end)
    batches = [b for p in parts for b in reader.read(p)]
    if not batches:
        return pa.table({"op": pa.array([], pa.string())})
    return pa.Table.from_batches(batches)


def key_of(t: pa.Table) -> pa.Table:
    return t.select(["op", "ts", "vchannel", "offset", "pk"]).sort_by([(k, "ascending") for k in KEY])


# --- a real streaming query -------------------------------------------------------------


def test_a_stream_sinks_every_change_once_in_order_and_a_restart_only_the_new_ones(
    log: Streamed, tmp_path: Path
) -> None:
    spark: Any = spark_session(log.system)
    log.write(0)
    log.persist()
    sink, checkpoint = str(tmp_path / "sink"), str(tmp_path / "checkpoint")

    sink_changes(spark, log.options(fields="n,vec"), sink, checkpoint)
    first = sink_rows(spark, sink)
    assert key_of(first).equals(log.changes())
    assert set(first["op"].to_pylist()) == {"insert", "delete"}
    assert first.schema.names == ["op", "ts", "vchannel", "offset", "partition_id", "pk", "n", "vec"]
    inserted = first.filter(pc.equal(first["op"], "insert")).to_pylist()
    assert all(len(r["vec"]) == 8 and r["n"] is not None for r in inserted)
    assert all(r["vec"] is None for r in first.filter(pc.equal(first["op"], "delete")).to_pylist())

    log.write(10_000, n=400)
    log.persist()
    # The same checkpoint: Spark continues from it.
    more = log.options(fields="n,vec", maxRowsPerTrigger="150")
    query = sink_changes(spark, more, sink, checkpoint)
    both = sink_rows(spark, sink)
    assert key_of(both).equals(log.changes())  # each change once, the old ones too
    assert len([p for p in query.recentProgress if p["numInputRows"]]) > 1  # capped batches
    # Spark commits a batch when it plans the next: the etcd record has all but the last.
    record = get_stream(log.store, f"test-{log.info.name}")
    assert record is not None and record.collection_id == log.info.id
    committed = {o.vchannel: o.offset for o in record.offsets}
    assert all(0 < committed[v] <= cp for v, cp in log.checkpoints().items())


def test_a_stream_without_a_stream_id_fails_in_spark_saying_what_to_add(log: Streamed) -> None:
    spark: Any = spark_session(log.system)
    options = {k: v for k, v in log.options().items() if k != "streamId"}
    query = spark.readStream.format("vchan").options(**options).load().writeStream.format("console").start()
    try:
        with pytest.raises(Exception, match=re.escape('needs .option("streamId", ID)')):
            query.awaitTermination(120)
    finally:
        query.stop()


def test_a_driver_killed_mid_batch_restarts_from_its_checkpoint_and_sinks_each_change_once(
    log: Streamed, tmp_path: Path
) -> None:
    for i in range(3):
        log.write(i * 1000, n=200, deletes=20)
    log.persist()
    sink, checkpoint, marker = str(tmp_path / "sink"), str(tmp_path / "checkpoint"), tmp_path / "marker"
    args = [log.info.name, sink, checkpoint, "maxRowsPerTrigger=200"]
    env = cli_env(log.settings, VCHAN_FAILPOINT="stream_read=stop-once", VCHAN_FAILPOINT_MARKER=str(marker))
    with open(tmp_path / "child.log", "wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "vchan_assets.testing.streams", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: marker.exists() or child.poll() is not None, timeout=300, what="a task mid-batch")
        assert child.poll() is None, (tmp_path / "child.log").read_text()[-3000:]
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the driver, its JVM, Spark's Python workers
        if marker.exists():
            with contextlib.suppress(ProcessLookupError):  # the stopped task, wherever it is
                os.kill(int(marker.read_text().split()[1]), signal.SIGKILL)
        child.wait()
    assert Path(checkpoint, "offsets", "0").exists()  # the batch was planned and logged, not committed
    assert not Path(checkpoint, "commits", "0").exists()

    spark: Any = spark_session(log.system)
    # Batch 0 is replayed as its offsets log planned it (200 rows); the rest comes in one
    # batch, not in three more of 200.
    sink_changes(spark, log.options(), sink, checkpoint)
    got = key_of(sink_rows(spark, sink))
    assert got.equals(log.changes())


# --- planning, driven as Spark's planner does ------------------------------------------


def test_up_to_checkpoint_stops_at_the_channel_checkpoints_and_head_at_the_log_end(log: Streamed) -> None:
    log.write(0)
    log.persist()
    log.write(10_000)  # in the log only
    persisted = log.reader()
    start = persisted.initialOffset()
    assert start == dict.fromkeys(log.info.vchannels, -1)  # earliest: nothing removed yet
    end = persisted.latestOffset(start, persisted.getDefaultReadLimit())
    assert end == log.checkpoints()
    assert key_of(batch(persisted, start, end)).equals(log.changes(up_to=end))

    head = log.reader(upTo="HEAD")
    to_head = head.latestOffset(start, head.getDefaultReadLimit())
    assert all(to_head[v] == log.log(v).end_offset() - 1 > end[v] for v in end)
    assert key_of(batch(head, end, to_head)).equals(log.changes(after=end))
    assert head.latestOffset(to_head, head.getDefaultReadLimit()) == to_head  # nothing new: no batch
    assert head.partitions(to_head, to_head) == []


def test_starting_offsets_earliest_latest_a_time_and_offsets(log: Streamed) -> None:
    log.write(0)
    # after every message so far (ticks included), before every later one
    between = max(pc.max(log.log(v).read()["timestamp"]).as_py() for v in log.info.vchannels) + 1
    time.sleep(0.05)
    log.write(10_000)

    def start(value: str) -> dict[str, int]:
        return VchanStreamReader(log.options(upTo="head", startingOffsets=value)).initialOffset()

    ends = {v: log.log(v).end_offset() - 1 for v in log.info.vchannels}
    assert start("latest") == ends
    assert start("EARLIEST") == dict.fromkeys(log.info.vchannels, -1)
    at = start(str(between))
    later = log.changes(after=at)
    assert (
        set(later["pk"].to_pylist()) == set(range(10_000, 10_300)) and min(later["ts"].to_pylist()) >= between
    )
    assert log.changes(up_to=at)["ts"].to_pylist()[-1] < between
    assert start(iso(between + (1 << 18))) == at  # ISO to the millisecond: the next one
    assert start(json.dumps(at)) == at


def test_max_rows_per_trigger_caps_a_batch_in_whole_log_files(log: Streamed) -> None:
    for i in range(4):
        log.write(i * 1000, n=100, deletes=0)
    reader = log.reader(upTo="head", maxRowsPerTrigger="80")
    limit = reader.getDefaultReadLimit()
    start, seen = reader.initialOffset(), []
    while (end := reader.latestOffset(start, limit)) != start:
        rows = batch(reader, start, end)
        assert 0 < rows.num_rows <= 2 * 80  # a share of 40 per vchannel, rounded up to a file (~50)
        seen.append(rows)
        start = end
    assert len(seen) == 4  # one insert batch's file per vchannel each
    assert key_of(pa.concat_tables(seen)).equals(log.changes())


# --- registration and retention --------------------------------------------------------


def test_retention_keeps_what_a_stream_has_not_committed_until_the_stream_is_idle(log: Streamed) -> None:
    for i in range(3):
        log.write(i * 1000, n=50, deletes=5)
        log.persist()
    reader = log.reader()
    start, end = log.first_batch(reader)  # registers the stream at `start`
    assert retention_holds(log.store, time.time(), log.settings.stream_idle_timeout) == start
    assert retain(log.system, expect_deletes=False) == []  # everything is after what it committed
    halfway = {v: o // 2 for v, o in end.items()}
    reader.commit(halfway)
    assert [s.offset_of(log.info.vchannels[0]) for s in list_streams(log.store).values()] == [
        halfway[log.info.vchannels[0]]
    ]
    deleted = retain(log.system, expect_deletes=False)
    assert deleted  # the files wholly at or before the commit
    for v in log.info.vchannels:
        first = log.log(v).files()[0]
        assert first.first_offset <= halfway[v] + 1  # the next offset to read is still there
    # Unseen for longer than the idle timeout: the stream holds nothing back any more.
    idle = log.settings.stream_idle_timeout
    assert retention_holds(log.store, time.time() + idle + 1, idle) == {}
    assert retain(log.system, later=idle + 1, expect_deletes=False)
    with pytest.raises(StreamOffsetRemovedError, match=r"offset \d+ was removed by log retention") as err:
        reader.latestOffset(halfway, reader.getDefaultReadLimit())
    oldest = log.log(err.value.vchannel).files()[0].first_offset
    assert (
        f"the oldest offset still readable is {oldest}" in str(err.value)
        and oldest > halfway[err.value.vchannel]
    )


def test_a_stream_that_starts_over_under_its_old_id_holds_the_log_from_its_new_start(log: Streamed) -> None:
    log.write(0, n=60, deletes=6)
    log.persist()
    first = log.reader()
    start, end = log.first_batch(first)
    first.commit(end)
    assert retention_holds(log.store, time.time(), log.settings.stream_idle_timeout) == end
    again = log.reader()  # a new Spark checkpoint: from earliest again
    again.latestOffset(again.initialOffset(), again.getDefaultReadLimit())
    assert retention_holds(log.store, time.time(), log.settings.stream_idle_timeout) == start


# --- clear errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "error", "names"),
    [
        ({"collection": "nope"}, CollectionNotFoundError, "nope"),
        ({"streamId": ""}, ReadOptionError, 'needs .option("streamId"'),
        ({"streamId": "a/b"}, ReadOptionError, "option streamId='a/b'"),
        ({"upTo": "tail"}, ReadOptionError, "option upTo='tail': expected one of checkpoint, head"),
        ({"maxRowsPerTrigger": "many"}, ReadOptionError, "option maxRowsPerTrigger='many'"),
        ({"startingOffsets": "yesterday"}, ReadOptionError, "option startingOffsets='yesterday'"),
        ({"startingOffsets": '{"x": 1'}, StreamOffsetError, "not JSON"),
        ({"startingOffsets": '{"x": 1}'}, StreamOffsetError, "not the collection's ['x']"),
        ({"startingOffsets": "[1]"}, StreamOffsetError, "expected a JSON object"),
        ({"fields": "nope"}, ReadOptionError, "has no field 'nope'"),
        ({"maxRowsPerTriger": "10"}, ReadOptionError, "unknown option 'maxrowspertriger'"),
        ({"pks": "1", "as_of": "0"}, ReadOptionError, "unknown options 'as_of', 'pks'"),
        ({"pks": "1"}, ReadOptionError, "options of the batch reader"),
    ],
)
def test_bad_options_are_clear_errors(
    log: Streamed, extra: dict[str, str], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=re.escape(names)):
        log.reader(**extra).initialOffset()


def test_a_collection_dropped_while_streamed_is_read_to_its_end_then_the_stream_fails(log: Streamed) -> None:
    log.write(0, n=60, deletes=6)
    log.persist()
    reader = log.reader()
    start, read = log.first_batch(reader)
    log.write(1000, n=60, deletes=6)  # never synced: the drop stops the syncs
    log.producer.drop_collection(log.info.name)
    rest = reader.latestOffset(read, reader.getDefaultReadLimit())  # to the head, not the checkpoint
    assert key_of(batch(reader, read, rest)).equals(log.changes(after=read))
    with pytest.raises(StreamCollectionDroppedError, match=f"collection '{log.info.name}' .* was dropped"):
        reader.latestOffset(rest, reader.getDefaultReadLimit())


def test_offsets_from_a_checkpoint_must_be_the_collections(log: Streamed) -> None:
    reader = log.reader()
    limit = reader.getDefaultReadLimit()
    a, b = log.info.vchannels
    with pytest.raises(StreamOffsetError, match=re.escape(f"missing ['{b}']")):
        reader.latestOffset({a: 3}, limit)
    with pytest.raises(StreamOffsetError, match="integers >= -1"):
        reader.latestOffset({a: "3", b: -2}, limit)


def test_a_checkpoint_of_a_collection_created_again_with_more_vchannels_is_a_clear_error(
    log: Streamed,
) -> None:
    log.write(0, n=60, deletes=6)
    reader = log.reader(upTo="head")
    _, end = log.first_batch(reader)
    log.producer.drop_collection(log.info.name)
    again = log.producer.create_collection(log.info.name, SCHEMA, num_channels=3)
    restarted = log.reader(upTo="head")  # Spark restarting the query from its checkpoint: at `end`
    with pytest.raises(StreamOffsetError, match="start the stream afresh") as err:
        restarted.latestOffset(end, restarted.getDefaultReadLimit())
    assert all(v in str(err.value) for v in [*again.vchannels, *log.info.vchannels])


def test_a_malformed_offset_in_the_spark_checkpoint_fails_the_restarted_query_naming_it(
    log: Streamed, tmp_path: Path
) -> None:
    spark: Any = spark_session(log.system)
    log.write(0, n=50, deletes=5)
    log.persist()
    sink, checkpoint = str(tmp_path / "sink"), tmp_path / "checkpoint"
    sink_changes(spark, log.options(), sink, str(checkpoint))
    last = max((p for p in (checkpoint / "offsets").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    version, metadata, _ = last.read_text().splitlines()
    last.write_text(f"{version}\n{metadata}\n{json.dumps({'elsewhere': 12})}")
    with pytest.raises(Exception, match=re.escape("""stream offsets {"elsewhere": 12}""")):
        sink_changes(spark, log.options(), sink, str(checkpoint))


def test_status_lists_streams_and_warns_of_an_idle_one(log: Streamed) -> None:
    log.write(0, n=40, deletes=0)
    reader = log.reader(upTo="head")
    start = reader.initialOffset()
    reader.commit(reader.latestOffset(start, reader.getDefaultReadLimit()))
    catalog = Catalog(log.system)
    [stream] = collect_status(catalog, orphans=False)["streams"]
    assert stream["stream"] == f"test-{log.info.name}" and stream["holds_retention"]
    assert stream["behind_head"] == 0 and set(stream["committed"]) == set(log.info.vchannels)
    later = collect_status(catalog, now=time.time() + log.settings.stream_idle_timeout + 1, orphans=False)
    assert not later["streams"][0]["holds_retention"]
    [idle] = [w for w in later["warnings"] if w["kind"] == "idle_stream"]
    assert f"test-{log.info.name}" in idle["message"] and "no longer holds log retention" in idle["message"]
    assert "no (idle)" in _rendered(later)


def _rendered(report: dict[str, Any]) -> str:
    console = Console(record=True, width=200)
    console.print(render_status(report))
    return console.export_text()
