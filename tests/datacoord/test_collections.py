"""Collections and partitions in etcd (CollectionRegistry), against a real etcd."""

from __future__ import annotations

import re
import threading

import pytest

from vchan_assets.datacoord.collections import (
    CollectionExistsError,
    CollectionNotFoundError,
    CollectionRegistry,
    InvalidNameError,
    InvalidSchemaError,
    PartitionExistsError,
    PartitionNotFoundError,
    vchannel_names,
)
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition
from vchan_assets.testing.steps import requests

SCHEMA = CollectionSchema.build("id", {"vector": 8}, {"age": "int64", "label": "string"})


@pytest.fixture
def catalog(store: MetaStore) -> CollectionRegistry:
    return CollectionRegistry(store)


def test_create_stores_the_collection_with_default_partition_and_vchannels(
    catalog: CollectionRegistry, store: MetaStore
) -> None:
    info = catalog.create("docs", SCHEMA, ["news"], num_channels=3)

    stored = store.get_model(store.keys.collection(info.id), CollectionInfo)
    assert stored is not None and stored.model == info
    assert stored.kv.version == 1
    assert info.partition_names == ("_default", "news")
    assert len(set(info.partitions)) == 2
    assert info.vchannels == tuple(f"{store.keys.root}-dml_{i}_{info.id}v{i}" for i in range(3))
    assert info.schema == SCHEMA


def test_a_duplicate_name_raises_collection_exists(catalog: CollectionRegistry) -> None:
    first = catalog.create("docs", SCHEMA)

    with pytest.raises(CollectionExistsError, match="docs") as err:
        catalog.create("docs", SCHEMA)
    assert err.value.collection_id == first.id
    assert [c.name for c in catalog.list()] == ["docs"]


def test_concurrent_creates_of_one_name_have_exactly_one_winner(store: MetaStore) -> None:
    results: list[object] = []

    def create() -> None:
        try:
            results.append(CollectionRegistry(store).create("race", SCHEMA))
        except CollectionExistsError as exc:
            results.append(exc)

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    winners = [r for r in results if isinstance(r, CollectionInfo)]
    assert len(winners) == 1
    assert len(CollectionRegistry(store).list()) == 1


def test_get_by_id_and_name_and_list(catalog: CollectionRegistry) -> None:
    a = catalog.create("a", SCHEMA)
    b = catalog.create("b", SCHEMA, num_channels=1)

    assert catalog.get(b.id) == b
    assert catalog.get_by_name("a") == a
    assert catalog.find("missing") is None
    assert [c.name for c in catalog.list()] == ["a", "b"]
    with pytest.raises(CollectionNotFoundError, match="missing"):
        catalog.get_by_name("missing")
    with pytest.raises(CollectionNotFoundError):
        catalog.get(123456789)


@pytest.mark.parametrize("name", ["", "1abc", "has space", "a/b", "x" * 256, "naïve"])
def test_invalid_names_are_rejected(catalog: CollectionRegistry, name: str) -> None:
    with pytest.raises(InvalidNameError):
        catalog.create(name, SCHEMA)
    with pytest.raises(InvalidNameError):
        catalog.create("ok", SCHEMA, [name]) if name else catalog.create("ok", SCHEMA, ["-"])


def test_a_schema_without_a_vector_is_rejected(catalog: CollectionRegistry) -> None:
    with pytest.raises(InvalidSchemaError, match="vector"):
        catalog.create("plain", CollectionSchema.build("id", {}, {"age": "int64"}))


def test_a_field_named_like_a_log_column_is_rejected(catalog: CollectionRegistry) -> None:
    with pytest.raises(InvalidSchemaError, match="reserved"):
        catalog.create("bad", CollectionSchema.build("id", {"vector": 4}, {"timestamp": "int64"}))


def test_create_and_drop_partition_update_the_meta(catalog: CollectionRegistry, store: MetaStore) -> None:
    info = catalog.create("docs", SCHEMA)

    updated, news_id = catalog.create_partition("docs", "news")
    assert updated.partition_names == ("_default", "news")
    assert updated.partition_id("news") == news_id
    with pytest.raises(PartitionExistsError):
        catalog.create_partition("docs", "news")

    after, dropped_id = catalog.drop_partition("docs", "news")
    assert dropped_id == news_id
    assert after.partition_names == ("_default",)
    assert catalog.get(info.id) == after
    with pytest.raises(PartitionNotFoundError):
        catalog.drop_partition("docs", "news")
    stored = store.get(store.keys.collection(info.id))
    assert stored is not None and stored.version == 3  # create, add, drop: one CAS each


def test_the_default_partition_cannot_be_dropped(catalog: CollectionRegistry) -> None:
    catalog.create("docs", SCHEMA)

    with pytest.raises(ValueError, match="_default"):
        catalog.drop_partition("docs", "_default")


def test_drop_frees_the_name_and_keeps_the_meta_for_the_log(catalog: CollectionRegistry) -> None:
    old = catalog.create("docs", SCHEMA)

    dropped = catalog.drop("docs")

    assert dropped.dropped_at > 0
    assert catalog.find("docs") is None
    assert catalog.list() == []
    assert catalog.get(old.id, include_dropped=True) == dropped
    assert catalog.create("docs", SCHEMA).id != old.id
    with pytest.raises(CollectionNotFoundError):
        catalog.drop("never")


def test_start_positions_are_recorded_per_vchannel(catalog: CollectionRegistry) -> None:
    info = catalog.create("docs", SCHEMA, num_channels=2)
    positions = [MsgPosition(ch, 0, 100 + i) for i, ch in enumerate(info.vchannels)]

    updated = catalog.set_start_positions(info.id, list(reversed(positions)))

    assert updated.start_positions == tuple(positions)
    assert catalog.get(info.id).start_positions == tuple(positions)


def test_vchannel_names_are_safe_as_path_and_key_segments() -> None:
    names = vchannel_names("team a/prod", 449, 2)

    assert names == ("team-a-prod-dml_0_449v0", "team-a-prod-dml_1_449v1")
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+", n) for n in names)


def test_a_name_read_again_costs_one_round_trip_and_follows_a_drop_and_a_new_collection(
    catalog: CollectionRegistry, store: MetaStore
) -> None:
    """The name's key and the record it named last time are read together; a record that
    changed (a partition), a dropped name and a name given to a new collection are seen at
    once, from any registry of the process."""
    first = catalog.create("named", SCHEMA)
    assert catalog.find("named") == first
    found: list[CollectionInfo] = []
    sent = requests(store, lambda: found.append(CollectionRegistry(store).get_by_name("named")))
    assert found == [first] and len(sent) == 1, sent

    catalog.create_partition("named", "p1")
    assert "p1" in CollectionRegistry(store).get_by_name("named").partition_names
    catalog.drop("named")
    assert CollectionRegistry(store).find("named") is None
    second = catalog.create("named", SCHEMA, num_channels=1)
    assert CollectionRegistry(store).get_by_name("named") == second != first
