"""The exactly-once sync against a real S3-compatible server (moto, its own process on
loopback), through VCHAN_STORAGE_URI=s3://...: the same code path as local storage."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from dataclasses import replace

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datacoord.recovery import list_orphans
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.embedded import free_port
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage, StorageError
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced, produce
from vchan_assets.testing.steps import assert_exactly_once
from vchan_assets.wal.producer import Producer

from .helpers import checkpoint, run_sync_process


@pytest.fixture
def s3_settings(settings: Settings, s3_server: dict[str, str]) -> Settings:
    prefix = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex[:8]}"
    return replace(settings, storage_uri=prefix, s3_endpoint=s3_server["endpoint"])


@pytest.mark.parametrize("step", ["after_binlogs", "before_checkpoint"])
def test_sync_on_s3_killed_at_a_commit_step_then_resynced_persists_every_row_exactly_once(
    step: str, s3_settings: Settings
) -> None:
    store = MetaStore.connect(s3_settings)
    storage = Storage.from_settings(s3_settings)
    assert storage.is_s3
    producer = Producer(System(s3_settings, store, storage))
    info = producer.create_collection(f"s3{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    produced = Produced()
    produce(producer, info.name, produced, 1500, start_pk=0, deletes=20)
    vchannel = info.vchannels[0]
    lease = grant_channel_lease(store, IdAllocator(store), vchannel, node_id=1)

    # Spark writes the files on S3 where they are what the killed step leaves behind; the
    # other step and the resync run in process (each JVM start is most of such a test).
    engine = "spark" if step == "after_binlogs" else "local"
    crashed = run_sync_process(s3_settings, info.name, vchannel, lease.lease_id, engine, VCHAN_FAILPOINT=step)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert checkpoint(store, vchannel) is None
    assert bool(list_orphans(store, storage)) == (step == "after_binlogs")

    resynced = run_sync_process(s3_settings, info.name, vchannel, lease.lease_id, "local")
    assert resynced.returncode == 0, resynced.stderr[-2000:]
    assert checkpoint(store, vchannel) is not None
    assert_exactly_once(store, storage, info, produced)
    store.close()


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.exists("wal/x/00000000000000000001.parquet"),
        lambda s: s.read_bytes("stats/x"),
        lambda s: s.read_parquet("insert_log/x.parquet"),
        lambda s: s.list_files("wal/x"),
        lambda s: s.write_atomic("stats/x", b"payload"),
        lambda s: s.delete("stats/x"),
    ],
    ids=["exists", "read_bytes", "read_parquet", "list_files", "write_atomic", "delete"],
)
def test_every_storage_call_to_an_s3_server_that_is_down_raises_storage_error_naming_the_path(
    call: Callable[[Storage], object], settings: Settings
) -> None:
    """An S3 outage must reach callers as StorageError (what the producer's and the sync's
    retries treat as transient), never as pyarrow's bare OSError: `exists` let one through
    while a producer looked for its own batch after a lost answer, and the producer died."""
    down = replace(
        settings, storage_uri="s3://vchan-test/down", s3_endpoint=f"http://127.0.0.1:{free_port()}"
    )
    with pytest.raises(StorageError, match="vchan-test/down/"):
        call(Storage.from_settings(down))
