"""The freshness check of the channel checkpoints (`checkpoints_fresh`) against a real etcd
and log: it fails when a vchannel with log messages to sync has waited longer than
VCHAN_CHECKPOINT_FRESHNESS, and passes when the wait is within the limit or the vchannel is
synced to its head."""

from __future__ import annotations

import time
from dataclasses import replace

import dagster as dg

from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.defs.health import checkpoint_freshness_sensor, checkpoints_fresh
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.model import CollectionInfo
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import SCHEMA, evaluate


def _evaluate(settings: Settings, limit: float) -> dg.AssetCheckResult:
    vchan = VchanResource.from_settings(replace(settings, checkpoint_freshness=limit))
    result = checkpoints_fresh(vchan=vchan)
    assert isinstance(result, dg.AssetCheckResult)
    return result


def test_a_vchannel_synced_to_its_head_is_fresh_however_old_its_checkpoint(
    dsettings: Settings, runtime: VchanRuntime, producer: Producer, collection: CollectionInfo
) -> None:
    """The log past the checkpoint (here the collection's creation, then rows) makes a
    vchannel one with messages to sync; once synced to its head it is fresh for ever."""
    producer.insert(collection.name, generate_rows(SCHEMA, 20, start_pk=1, seed=1))
    producer.time_tick(collection.name)
    time.sleep(1.2)
    assert not _evaluate(dsettings, limit=1.0).passed
    ids = IdAllocator(runtime.store)
    for vchannel in collection.vchannels:
        lease = grant_channel_lease(runtime.store, ids, vchannel, node_id=1)
        runtime.sync(vchannel, lease.lease_id, engine="local")
    time.sleep(1.2)

    result = _evaluate(dsettings, limit=1.0)

    assert result.passed, result.description
    assert result.metadata["stale"].value == 0 and result.metadata["with_messages_to_sync"].value == 0


def test_rows_waiting_longer_than_the_limit_make_the_check_fail(
    dsettings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    producer.insert(collection.name, generate_rows(SCHEMA, 20, start_pk=1, seed=1))
    producer.time_tick(collection.name)
    time.sleep(1.5)

    stale = _evaluate(dsettings, limit=1.0)
    fresh = _evaluate(dsettings, limit=3600.0)

    assert not stale.passed and stale.severity == dg.AssetCheckSeverity.ERROR
    assert stale.metadata["stale"].value >= 1
    assert float(stale.metadata["oldest_unsynced_s"].value) > 1.0  # type: ignore[arg-type]
    assert any(v in (stale.description or "") for v in collection.vchannels)
    assert (
        fresh.passed
        and fresh.metadata["with_messages_to_sync"].value == stale.metadata["with_messages_to_sync"].value
    )


def test_the_sensor_reports_the_evaluation_without_a_run(
    dsettings: Settings, producer: Producer, collection: CollectionInfo, instance: dg.DagsterInstance
) -> None:
    """`checkpoint_freshness_sensor` evaluates the same check and returns its evaluation as an
    asset event of the tick (no run request)."""
    producer.insert(collection.name, generate_rows(SCHEMA, 20, start_pk=1, seed=1))
    time.sleep(1.2)
    vchan = VchanResource.from_settings(replace(dsettings, checkpoint_freshness=1.0))

    result = evaluate(checkpoint_freshness_sensor, instance, vchan)

    assert not result.run_requests
    (event,) = result.asset_events
    assert isinstance(event, dg.AssetCheckEvaluation)
    assert event.asset_check_key == dg.AssetCheckKey(dg.AssetKey("channel_checkpoints"), "checkpoints_fresh")
    assert not event.passed and event.severity == dg.AssetCheckSeverity.ERROR
