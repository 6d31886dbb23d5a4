"""Write back-pressure (`wal.backpressure`): a channel whose checkpoint lags its log too far
slows its writers, then refuses inserts and deletes; flush goes on; writes resume by
themselves once a sync catches the channel up. Real etcd, real log files, a real sync."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema
from vchan_assets.status import collect_status
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.steps import sync_all
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.backpressure import MB, WriteLagExceededError, WriteLimiter, channel_lag
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader

SCHEMA = CollectionSchema.build("id", {"vector": 16}, {})
BATCH = 200  # rows per insert: a log file of some 15 KB


def _limited(settings: Settings, store: MetaStore, storage: Storage, **limits: float) -> Producer:
    return Producer(System(replace(settings, **limits), store, storage))


def _insert_until_refused(
    producer: Producer, name: str, most: int = 200
) -> tuple[int, WriteLagExceededError]:
    """Insert batches until one is refused; the rows written before it and the error."""
    for i in range(most):
        try:
            producer.insert(name, generate_rows(SCHEMA, BATCH, start_pk=i * BATCH))
        except WriteLagExceededError as refused:
            return i * BATCH, refused
    raise AssertionError(f"{most} inserts were never refused")


def test_a_lagging_channel_slows_then_refuses_inserts_naming_the_channel_and_its_lag(
    settings: Settings, store: MetaStore, storage: Storage
) -> None:
    producer = _limited(settings, store, storage, write_lag_limit_mb=0.2)
    slept: list[float] = []
    producer.limiter = WriteLimiter(store, storage, replace(settings, write_lag_limit_mb=0.2), slept.append)
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    vchannel = info.vchannels[0]

    written, refused = _insert_until_refused(producer, info.name)

    assert refused.vchannel == vchannel and refused.lag_mb > 0.2
    assert vchannel in str(refused) and "VCHAN_WRITE_LAG_LIMIT_MB=0.2" in str(refused)
    assert slept and max(slept) <= 1.0, "writes slowed before they were refused"
    end = WalReader(storage, vchannel, info).end_offset()
    with pytest.raises(WriteLagExceededError):  # a refused call writes nothing
        producer.delete(info.name, [0])
    assert WalReader(storage, vchannel, info).end_offset() == end
    lag = channel_lag(store, WalReader(storage, vchannel, info), info)
    assert lag.bytes < 0.2 * MB * 1.5, "the log after the checkpoint stays near the limit"
    assert written > 0
    with Catalog(System(replace(settings, write_lag_limit_mb=0.2), store, storage)) as catalog:
        warnings = collect_status(catalog, orphans=False)["warnings"]
    assert any(w["kind"] == "writes_refused" and w["vchannel"] == vchannel for w in warnings), warnings


def test_flush_goes_on_and_writes_resume_by_themselves_once_a_sync_catches_up(
    system: System, settings: Settings, store: MetaStore, storage: Storage
) -> None:
    producer = _limited(settings, store, storage, write_lag_limit_mb=0.2)
    producer.limiter.sleep = lambda _: None
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    _insert_until_refused(producer, info.name)

    flush_ts = producer.flush(info.name)  # not refused: it is how the channel catches up
    sync_all(system, info)
    assert producer.flush_state(info.name, flush_ts)

    def accepted() -> bool:
        try:
            producer.insert(info.name, generate_rows(SCHEMA, BATCH, start_pk=10**6))
        except WriteLagExceededError:
            return False
        return True

    # The producer reads the lag again within a second: no restart, no call.
    wait_until(accepted, 10, "writes to resume after the sync (an insert accepted)", interval=0.2)


def test_the_age_limit_refuses_writes_once_the_oldest_unsynced_message_is_too_old(
    settings: Settings, store: MetaStore, storage: Storage
) -> None:
    producer = _limited(settings, store, storage, write_lag_limit_mb=0.0, write_lag_limit_seconds=1.0)
    producer.limiter.sleep = lambda _: None
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    producer.insert(info.name, generate_rows(SCHEMA, BATCH))
    time.sleep(2.5)  # the insert's rows age past the limit (and the cached lag expires)

    with pytest.raises(WriteLagExceededError) as refused:
        producer.insert(info.name, generate_rows(SCHEMA, BATCH, start_pk=BATCH))
    assert refused.value.lag_seconds > 1.0 and "VCHAN_WRITE_LAG_LIMIT_SECONDS=1" in str(refused.value)


def test_no_limit_never_slows_or_refuses(settings: Settings, store: MetaStore, storage: Storage) -> None:
    producer = _limited(settings, store, storage, write_lag_limit_mb=0.0)
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    for i in range(5):
        producer.insert(info.name, generate_rows(SCHEMA, BATCH, start_pk=i * BATCH))
    assert (producer.limiter.slowed, producer.limiter.refused) == (0, 0)


def test_a_lag_that_cannot_be_read_never_refuses_a_write(
    settings: Settings, store: MetaStore, storage: Storage
) -> None:
    producer = _limited(settings, store, storage, write_lag_limit_mb=0.2)
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    producer.insert(info.name, generate_rows(SCHEMA, BATCH))
    damaged = Path(storage.path(WalReader(storage, info.vchannels[0], info).files()[1].key))
    damaged.write_bytes(damaged.read_bytes()[:50])  # the sync's to report, not the producer's
    time.sleep(1.2)  # the cached reading expires

    producer.insert(info.name, generate_rows(SCHEMA, BATCH, start_pk=BATCH))

    assert producer.limiter.refused == 0
