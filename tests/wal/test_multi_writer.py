"""Many producer processes on one collection: dense offsets, monotonic timestamps, one
allocation authority, inserts and deletes with a concurrent flush (Python API and
`vchan produce`), crash safety, retries through etcd and S3 outages. Every producer here
is its own OS process (tests/wal/producer_child.py); the sync runs in-process with the
local engine. Concurrency is arranged by handshakes (files, SIGSTOP), never by timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.errors import MetaUnavailableError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import Produced
from vchan_assets.testing.steps import assert_exactly_once, sync_all
from vchan_assets.testing.tcp_proxy import Endpoint
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.format import data_prefix
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader

from .producer_child import DELETE_ENV, FLUSH_COUNT_ENV, GATE_ENV, SCHEMA

CHILD = Path(__file__).parent / "producer_child.py"


def child_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(settings.to_env())
    return env


def start(settings: Settings, *args: object, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), *map(str, args)],
        env={**child_env(settings), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}): {err[-3000:]}"
    return out


def wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 60, contains: str = "") -> None:
    """Read the child's output up to a line starting with `prefix` (and holding `contains`).
    The timeout only keeps a broken child from hanging the test."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix) and contains in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) before {prefix!r}")
    raise AssertionError(f"no {prefix!r} within {timeout}s")


def expected_rows(start_pk: int, batches: int, rows: int) -> list[pa.Table]:
    return [
        generate_rows(SCHEMA, rows, start_pk=start_pk + i * rows, seed=start_pk + i * rows)
        for i in range(batches)
    ]


def check_log(storage: Storage, info: CollectionInfo) -> dict[str, pa.Table]:
    """Per channel: offsets dense from 0 (the reader refuses gaps), timestamps never
    decreasing with the offset and strictly increasing from one batch to the next."""
    logs = {}
    for vchannel in info.vchannels:
        reader = WalReader(storage, vchannel, info)
        files = reader.files()
        table = reader.read()
        assert table["offset"].to_pylist() == list(range(table.num_rows))
        ts = table["timestamp"].to_numpy()
        assert bool((np.diff(ts) >= 0).all()), f"{vchannel}: a timestamp goes back"
        for before, after in zip(files, files[1:], strict=False):
            assert after.first_timestamp is not None and after.first_timestamp > before.last_timestamp
        logs[vchannel] = table
    return logs


def inserted_pks(logs: dict[str, pa.Table]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for table in logs.values():
        inserts = table.filter(pc.equal(table["msg_type"], "insert"))
        counts.update(inserts["pk"].to_pylist())
    return counts


def deleted_pks(logs: dict[str, pa.Table]) -> list[int]:
    return [
        pk
        for table in logs.values()
        for pk in table.filter(pc.equal(table["msg_type"], "delete"))["pk"].to_pylist()
    ]


def segments(store: MetaStore, info: CollectionInfo) -> dict[int, SegmentInfo]:
    found, _ = store.list_models(store.keys.segment.under(info.id), SegmentInfo)
    return {d.model.id: d.model for d in found}


def assert_no_row_at_or_after_its_seal(
    logs: dict[str, pa.Table], sealed: dict[int, SegmentInfo], all_sealed: bool
) -> None:
    """One allocation authority: every insert is stamped below its segment's seal_ts
    (with `all_sealed`, every segment that holds rows must be sealed)."""
    for table in logs.values():
        inserts = table.filter(pc.equal(table["msg_type"], "insert"))
        for segment_id, ts in zip(
            inserts["segment_id"].to_pylist(), inserts["timestamp"].to_pylist(), strict=True
        ):
            seal_ts = sealed[segment_id].seal_ts
            assert seal_ts > 0 or not all_sealed, f"segment {segment_id} is not sealed"
            assert seal_ts == 0 or ts < seal_ts, f"row at ts {ts} in segment {segment_id} sealed at {seal_ts}"


@pytest.fixture
def fast(settings: Settings) -> Settings:
    """Small segments (sealed by size while the test runs) and a short lock TTL."""
    return replace(settings, segment_max_size_mb=3000 * SCHEMA.row_bytes() / (1 << 20), append_lock_ttl=2.0)


def test_four_producer_processes_and_a_flusher_keep_the_log_and_segments_consistent(
    store: MetaStore, storage: Storage, fast: Settings, tmp_path: Path
) -> None:
    producer = Producer(System(fast, store, storage))
    info = producer.create_collection(f"c{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    batches, rows = 12, 400
    stop, flush_count = tmp_path / "stop", tmp_path / "flushes"
    flusher = start(fast, "flush", info.name, 0.5, stop, flush_count)
    # Each producer, halfway through, waits for the flusher's count to grow: at least one
    # flush falls between every producer's batches, however fast either side runs. Then
    # it deletes its first `deletes` pks (while the others may still insert).
    deletes = 50
    gate = {FLUSH_COUNT_ENV: str(flush_count), DELETE_ENV: str(deletes)}
    children = [
        start(fast, "insert", info.name, 100_000 * (k + 1), batches, rows, env=gate) for k in range(4)
    ]
    for child in children:
        finish(child)
    stop.touch()
    flush_stamps = [
        int(line.split()[1]) for line in finish(flusher).splitlines() if line.startswith("flush ")
    ]

    flush_ts = producer.flush(info.name)
    logs = check_log(storage, info)
    counts = inserted_pks(logs)
    insert_ts = [t for table in logs.values() for t in table["timestamp"].to_pylist()]
    assert any(min(insert_ts) < ts < max(insert_ts) for ts in flush_stamps), (
        "a flush should fall between the producers' inserts"
    )
    produced = pa.concat_tables(
        [t for k in range(4) for t in expected_rows(100_000 * (k + 1), batches, rows)]
    )
    assert sorted(counts) == sorted(produced["pk"].to_pylist()) and max(counts.values()) == 1
    deleted = [pk for k in range(4) for pk in range(100_000 * (k + 1), 100_000 * (k + 1) + deletes)]
    assert sorted(deleted_pks(logs)) == deleted

    # One allocation authority: no row is stamped at or after its segment's seal.
    sealed = segments(store, info)
    assert_no_row_at_or_after_its_seal(logs, sealed, all_sealed=True)
    assert (
        len([s for s in sealed.values() if s.level is SegmentLevel.L1]) > 2
    )  # sealed by size and by flushes

    sync_all(System(fast, store, storage), info)
    assert producer.flush_state(info.name, flush_ts)
    assert_exactly_once(store, storage, info, Produced(rows=[produced], deleted=deleted))


@pytest.mark.parametrize("failpoint", ["after_wal_data", "before_wal_publish", "after_wal_publish"])
def test_a_producer_killed_mid_append_leaves_no_hole_and_no_half_batch(
    store: MetaStore, storage: Storage, fast: Settings, failpoint: str
) -> None:
    producer = Producer(System(fast, store, storage))
    info = producer.create_collection(f"k{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
    batches, rows, kill_at = 8, 300, 3
    victim = start(fast, "insert", info.name, 0, batches, rows, kill_at, failpoint)
    others = [start(fast, "insert", info.name, 100_000 * (k + 1), batches, rows) for k in range(2)]
    victim.communicate(timeout=120)
    assert victim.returncode == -9, "the failpoint should have SIGKILLed the producer"
    for child in others:
        finish(child)  # they went on: past the dead writer's lock (lease expiry) or its file
    producer.insert(info.name, generate_rows(SCHEMA, 10, start_pk=900_000))  # the log takes more

    counts = inserted_pks(check_log(storage, info))
    assert max(counts.values()) == 1
    victim_batches = kill_at + (failpoint == "after_wal_publish")  # a published batch is in the log
    [vchannel] = info.vchannels
    named = {f.data_key for f in WalReader(storage, vchannel, info).files()}
    orphans = [i for i in storage.list_files(data_prefix(vchannel)) if storage.key_of(i.path) not in named]
    assert len(orphans) == (failpoint != "after_wal_publish"), "the victim's data file, no log file names it"
    expected = [t for k in range(2) for t in expected_rows(100_000 * (k + 1), batches, rows)]
    expected += expected_rows(0, victim_batches, rows)
    want = pa.concat_tables(expected)["pk"].to_pylist() + list(range(900_000, 900_010))
    assert sorted(counts) == sorted(want)


def test_producers_retry_through_an_etcd_restart_and_write_every_batch_once(
    private_store: MetaStore,
    storage: Storage,
    private_settings: Settings,
    private_etcd: EmbeddedEtcd,
    tmp_path: Path,
) -> None:
    settings = replace(private_settings, client_retry_timeout=60.0, etcd_timeout=2.0, append_lock_ttl=2.0)
    producer = Producer(System(settings, private_store, storage))
    info = producer.create_collection(f"r{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    batches, rows = 10, 200
    # Each producer writes 3 batches, then waits for `down` before its 4th: etcd is down
    # by then, so every producer's 4th batch meets the outage, whatever their speed.
    down = tmp_path / "etcd-down"
    gate = {GATE_ENV: f"{down}:3"}
    children = [
        start(settings, "insert", info.name, 100_000 * (k + 1), batches, rows, env=gate) for k in range(2)
    ]
    for child in children:
        wait_for_line(child, "batch 2")
    private_etcd.stop()
    down.touch()
    for child in children:
        wait_for_line(child, "WARNING", contains="retrying")  # the outage reached it
    private_etcd.restart()  # same ports and data
    for child in children:
        finish(child)

    counts = inserted_pks(check_log(storage, info))
    produced = pa.concat_tables(
        [t for k in range(2) for t in expected_rows(100_000 * (k + 1), batches, rows)]
    )
    assert sorted(counts) == sorted(produced["pk"].to_pylist()) and max(counts.values()) == 1


def test_producers_retry_through_an_s3_outage_and_write_every_batch_once(
    store: MetaStore, settings: Settings, s3_server: dict[str, str], tmp_path: Path
) -> None:
    """Storage unavailable: the producers reach S3 through a proxy process that is killed
    (every connection reset, new ones refused) while each waits at a gate before its 4th
    batch, and started again once every producer has reported a retry."""
    direct = replace(
        settings,
        storage_uri=f"s3://{s3_server['bucket']}/{uuid.uuid4().hex[:8]}",
        s3_endpoint=s3_server["endpoint"],
        client_retry_timeout=60.0,
        append_lock_ttl=2.0,
    )
    proxy = Endpoint(s3_server["endpoint"], tmp_path / "proxy.log")
    proxy.start()
    storage = Storage.from_settings(direct)  # the checks reach the server directly
    info = Producer(System(direct, store, storage)).create_collection(f"s{uuid.uuid4().hex[:6]}", SCHEMA)
    batches, rows = 8, 200
    down = tmp_path / "s3-down"
    through_proxy = replace(direct, s3_endpoint=proxy.url)
    gate = {GATE_ENV: f"{down}:3"}
    children = [
        start(through_proxy, "insert", info.name, 100_000 * (k + 1), batches, rows, env=gate)
        for k in range(2)
    ]
    try:
        for child in children:
            wait_for_line(child, "batch 2")
        proxy.kill()
        down.touch()
        for child in children:
            wait_for_line(child, "WARNING", contains="retrying")  # the outage reached it
        proxy.start()  # same port
        for child in children:
            finish(child)
    finally:
        if proxy.process is not None and proxy.process.poll() is None:
            proxy.kill()

    counts = inserted_pks(check_log(storage, info))
    produced = pa.concat_tables(
        [t for k in range(2) for t in expected_rows(100_000 * (k + 1), batches, rows)]
    )
    assert sorted(counts) == sorted(produced["pk"].to_pylist()) and max(counts.values()) == 1


def test_a_segment_flushed_by_another_client_receives_no_more_rows(system: System, store: MetaStore) -> None:
    inserter, flusher = Producer(system), Producer(system)
    info = inserter.create_collection(f"f{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
    first = inserter.insert(info.name, generate_rows(SCHEMA, 10, start_pk=0))[info.vchannels[0]]

    flusher.flush(info.name)  # another client: seals the segment the inserter is filling
    second = inserter.insert(info.name, generate_rows(SCHEMA, 10, start_pk=10))[info.vchannels[0]]

    [(old, _)] = first.segments
    [(new, _)] = second.segments
    assert new != old
    sealed = segments(store, info)[old]
    assert second.timestamp > sealed.seal_ts > first.timestamp


def test_vchan_produce_and_a_flush_from_a_second_vchan_produce_both_succeed(
    store: MetaStore, storage: Storage, fast: Settings
) -> None:
    """`vchan produce` loading rows while another `vchan produce --rows 1 --flush` runs:
    the second client flushes in the middle of the first one's batches (the first is
    stopped with SIGSTOP once its log holds rows, resumed after the flush), and every
    row is in the log once, none after its segment's seal."""
    info = Producer(System(fast, store, storage)).create_collection(f"v{uuid.uuid4().hex[:6]}", SCHEMA)
    env = child_env(fast)
    command = [sys.executable, "-m", "vchan_assets.cli", "produce", "--collection", info.name]
    loader = subprocess.Popen(
        [*command, "--rows", "20000", "--batch", "200", "--start-pk", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def wrote_a_batch() -> bool:
        if len(WalReader(storage, info.vchannels[0], info).files()) >= 2:
            return True
        assert loader.poll() is None, f"the loader exited ({loader.returncode}) before writing a batch"
        return False

    wait_until(wrote_a_batch, 120, "the loader's first batch in the log", interval=0.02)
    loader.send_signal(signal.SIGSTOP)  # it may hold a lock: its lease expires, the flush goes on
    try:
        flusher = subprocess.run(
            [*command, "--rows", "1", "--start-pk", "900000", "--flush"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        loader.send_signal(signal.SIGCONT)
    assert flusher.returncode == 0, flusher.stderr
    assert finish(loader).startswith("inserted 20000 rows")
    flush_ts = int(flusher.stdout.split("flush_ts ")[1].split()[0])

    logs = check_log(storage, info)
    counts = inserted_pks(logs)
    assert sorted(counts) == [*range(20000), 900000] and max(counts.values()) == 1
    insert_ts = [t for table in logs.values() for t in table["timestamp"].to_pylist()]
    assert min(insert_ts) < flush_ts < max(insert_ts), "the flush fell between the loader's batches"
    assert_no_row_at_or_after_its_seal(logs, segments(store, info), all_sealed=False)


def test_a_producer_gives_up_after_its_retry_timeout_with_the_etcd_message_and_writes_nothing(
    private_store: MetaStore,
    storage: Storage,
    private_settings: Settings,
    private_etcd: EmbeddedEtcd,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = replace(private_settings, client_retry_timeout=1.0, etcd_timeout=0.5)
    producer = Producer(System(settings, private_store, storage))
    info = producer.create_collection(f"g{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
    files_before = WalReader(storage, info.vchannels[0], info).files()
    private_etcd.stop()

    with caplog.at_level("WARNING"), pytest.raises(MetaUnavailableError) as down:
        producer.insert(info.name, generate_rows(SCHEMA, 10, start_pk=0))

    assert private_etcd.endpoint in str(down.value) and "VCHAN_ETCD_ENDPOINTS" in str(down.value)
    assert "retrying" in caplog.text  # it retried before giving up
    assert WalReader(storage, info.vchannels[0], info).files() == files_before
