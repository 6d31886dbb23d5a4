"""A DataNode decides when to sync the same way whether it runs as `vchan datanode` or
inside Dagster's sync sensor: both read the channel through one read model."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from vchan_assets.config import Settings
from vchan_assets.datanode.channel import NodeContext, channel_backlog
from vchan_assets.datanode.policies import sync_reasons
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 4}, {"n": "int64"})


def _nothing(producer: Producer, info: CollectionInfo) -> None:
    pass


def _flushed_and_ticked(producer: Producer, info: CollectionInfo) -> None:
    producer.flush(info.name)  # seals, then a time tick past the seal


def _sealed_past_the_head(producer: Producer, info: CollectionInfo) -> None:
    producer.segments.flush(info.id)  # seals at a timestamp no time tick has reached yet


def _decisions(
    settings: Settings, store: MetaStore, storage: Storage, info: CollectionInfo
) -> tuple[list[str], list[str]]:
    vchannel = info.vchannels[0]
    now = time.time()  # one clock for both hosts
    runtime = VchanRuntime(settings, store, storage)
    node = NodeContext(runtime, node_id=1)
    standalone = sync_reasons(channel_backlog(node, info, vchannel), settings, now)
    dagster = runtime.sync_reasons(runtime.status(vchannel, info), now)
    return standalone, dagster


@pytest.mark.parametrize("then", [_nothing, _flushed_and_ticked, _sealed_past_the_head])
def test_both_hosts_give_the_same_sync_decision_for_the_same_etcd_state(
    settings: Settings,
    store: MetaStore,
    storage: Storage,
    producer: Producer,
    then: Callable[[Producer, CollectionInfo], None],
) -> None:
    info = producer.create_collection(f"d{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
    producer.insert(info.name, generate_rows(SCHEMA, 50, start_pk=0, seed=1))
    then(producer, info)

    standalone, dagster = _decisions(settings, store, storage, info)

    assert standalone == dagster


def test_a_flush_not_yet_reached_by_a_time_tick_asks_for_a_sync_of_what_is_buffered(
    settings: Settings, store: MetaStore, storage: Storage, producer: Producer
) -> None:
    info = producer.create_collection(f"d{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
    producer.insert(info.name, generate_rows(SCHEMA, 50, start_pk=0, seed=1))
    _sealed_past_the_head(producer, info)

    standalone, dagster = _decisions(settings, store, storage, info)

    # The sealed segment cannot be flushed before a tick passes its seal: no "sealed
    # segment" reason yet, but the buffered rows are synced for the flush.
    assert [r.split(" at ")[0] for r in dagster] == ["flush requested"]
    assert standalone == dagster
