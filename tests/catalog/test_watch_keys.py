"""Everyone reads `channelwatch/` the same way: a channel waiting in `remaining/` is not a
malformed watch info, and a key of the wrong shape is reported, not hidden."""

from __future__ import annotations

import uuid

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.meta.store import MetaStore
from vchan_assets.metrics import exposition
from vchan_assets.model import CollectionInfo, VchannelInfo
from vchan_assets.status import collect_status
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

from .helpers import SCHEMA


@pytest.fixture
def waiting(store: MetaStore, producer: Producer) -> CollectionInfo:
    """A collection whose vchannels wait in `remaining/` (no live DataNode), as the
    coordinator parks them."""
    info = producer.create_collection(f"w{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=2)
    for vchannel in info.vchannels:
        store.put(store.keys.remaining_channel(vchannel), VchannelInfo(info.id, vchannel))
    return info


def test_a_remaining_channel_is_unassigned_not_malformed(system: System, waiting: CollectionInfo) -> None:
    report = collect_status(Catalog(system), orphans=False)

    kinds = {(w["kind"], w.get("vchannel")) for w in report["warnings"]}
    for vchannel in waiting.vchannels:
        assert ("unassigned", vchannel) in kinds
        assert ("malformed_watch", vchannel) not in kinds
    rows = {r["vchannel"]: r for r in report["channels"]}
    assert {rows[v]["owner_node"] for v in waiting.vchannels} == {"remaining"}
    assert {rows[v]["watch_state"] for v in waiting.vchannels} == {None}


def test_remaining_channels_are_not_counted_as_malformed_watch_infos(
    system: System, waiting: CollectionInfo
) -> None:
    text = exposition(Catalog(system))

    assert 'state="Malformed"' not in text


def test_a_watch_key_of_the_wrong_shape_is_reported(
    system: System, store: MetaStore, waiting: CollectionInfo
) -> None:
    bad = store.keys.channel_watch.prefix + "not-a-node/" + waiting.vchannels[0]
    store.put(bad, {"anything": 1})

    report = collect_status(Catalog(system), orphans=False)

    malformed = [w for w in report["warnings"] if w["kind"] == "malformed_watch"]
    assert [w["vchannel"] for w in malformed] == [waiting.vchannels[0]]
    assert bad in malformed[0]["message"]
