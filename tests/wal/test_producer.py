"""The producer (proxy role): routing, segment IDs, time ticks, deletes and DDL in the log."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry, PartitionNotFoundError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition, SegmentInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal import WalReader
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("id", {"vector": 8}, {"age": "int64", "label": "string", "score": "float"})


@pytest.fixture
def docs(producer: Producer) -> CollectionInfo:
    return producer.create_collection("docs", SCHEMA, ["news"], num_channels=3)


def channel_log(storage: Storage, info: CollectionInfo, vchannel: str) -> pa.Table:
    return WalReader(storage, vchannel, info).read()


def of_type(table: pa.Table, kind: str) -> pa.Table:
    return table.filter(pc.equal(table["msg_type"], kind))


def test_create_collection_writes_its_message_at_offset_zero_of_every_channel(
    producer: Producer, storage: Storage, docs: CollectionInfo
) -> None:
    for vchannel, start in zip(docs.vchannels, docs.start_positions, strict=True):
        log = channel_log(storage, docs, vchannel)
        assert log["msg_type"].to_pylist() == ["create_collection", "timetick"]
        assert start == MsgPosition(vchannel, 0, log["timestamp"][0].as_py())
        payload = json.loads(log["payload"][0].as_py())
        assert (payload["id"], payload["name"], payload["partition_names"]) == (
            docs.id,
            "docs",
            ["_default", "news"],
        )
    assert producer.catalog.get(docs.id).start_positions == docs.start_positions


def test_insert_routes_rows_to_vchannels_by_pk_modulo_k(
    producer: Producer, storage: Storage, docs: CollectionInfo
) -> None:
    rows = generate_rows(SCHEMA, 300, start_pk=1000, seed=3)

    producer.insert("docs", rows)

    seen = []
    for i, vchannel in enumerate(docs.vchannels):
        inserts = of_type(channel_log(storage, docs, vchannel), "insert")
        assert all(pk % 3 == i for pk in inserts["id"].to_pylist())
        seen.append(inserts.select(rows.column_names))
    everything = pa.concat_tables(seen).sort_by("id")
    assert everything.equals(rows.sort_by("id"))


def test_every_batch_ends_with_a_time_tick_that_becomes_the_head(
    producer: Producer, storage: Storage, docs: CollectionInfo
) -> None:
    results = producer.insert("docs", generate_rows(SCHEMA, 90, seed=1))

    for vchannel, result in results.items():
        log = channel_log(storage, docs, vchannel)
        assert log["msg_type"][-1].as_py() == "timetick"
        assert log["offset"][-1].as_py() == result.last_offset
        assert WalReader(storage, vchannel, docs).head() == result.position
        inserts = of_type(log, "insert")
        assert inserts.num_rows == result.rows
        assert pc.max(inserts["timestamp"]).as_py() < result.timestamp


def test_inserted_rows_carry_segments_assigned_by_the_segment_manager(
    producer: Producer, store: MetaStore, storage: Storage, docs: CollectionInfo
) -> None:
    results = producer.insert("docs", generate_rows(SCHEMA, 60), partition="news")

    segments, _ = store.list_models(store.keys.segment.under(docs.id), SegmentInfo)
    by_id = {d.model.id: d.model for d in segments}
    for vchannel, result in results.items():
        [(segment_id, rows)] = result.segments
        inserts = of_type(channel_log(storage, docs, vchannel), "insert")
        assert set(inserts["segment_id"].to_pylist()) == {segment_id}
        assert set(inserts["partition_id"].to_pylist()) == {docs.partition_id("news")}
        assert rows == inserts.num_rows
        seg = by_id[segment_id]
        assert (seg.vchannel, seg.partition_id, seg.state) == (
            vchannel,
            docs.partition_id("news"),
            SegmentState.GROWING,
        )


def test_vectors_are_accepted_as_numpy_lists_or_fixed_size_binary(
    producer: Producer, storage: Storage, store: MetaStore, settings: Settings
) -> None:
    producer.create_collection("one", SCHEMA, num_channels=1)
    matrix = np.random.default_rng(0).random((3, 8), dtype=np.float32)
    common = {"age": [1, 2, 3], "label": ["a", "b", "c"], "score": [0.5, 1.5, 2.5]}

    producer.insert("one", {"id": [1, 2, 3], "vector": matrix, **common})
    producer.insert("one", {"id": [4, 5, 6], "vector": matrix.tolist(), **common})
    as_list = pa.array(matrix.tolist(), pa.list_(pa.float32(), 8))
    producer.insert("one", pa.table({"id": [7, 8, 9], "vector": as_list, **common}))

    info = producer.collection("one")
    vectors = of_type(channel_log(storage, info, info.vchannels[0]), "insert")["vector"]
    assert vectors.type == pa.binary(32)
    decoded = np.frombuffer(b"".join(vectors.to_pylist()), dtype="<f4").reshape(9, 8)
    assert np.array_equal(decoded, np.vstack([matrix] * 3))


def test_rows_that_do_not_fit_the_schema_are_rejected_before_anything_is_written(
    producer: Producer, storage: Storage, docs: CollectionInfo
) -> None:
    rows = generate_rows(SCHEMA, 10)
    before = [WalReader(storage, ch, docs).end_offset() for ch in docs.vchannels]

    with pytest.raises(ValueError, match="missing \\['score'\\]"):
        producer.insert("docs", rows.drop_columns(["score"]))
    with pytest.raises(ValueError, match="'vector'"):
        producer.insert("docs", rows.set_column(1, "vector", pa.array([b"short"] * 10)))
    with pytest.raises(PartitionNotFoundError):
        producer.insert("docs", rows, partition="nope")
    assert [WalReader(storage, ch, docs).end_offset() for ch in docs.vchannels] == before


def test_delete_without_a_partition_deletes_in_every_partition(
    producer: Producer, storage: Storage, docs: CollectionInfo
) -> None:
    producer.delete("docs", [3, 4, 5])

    for i, vchannel in enumerate(docs.vchannels):
        log = channel_log(storage, docs, vchannel)
        deletes = of_type(log, "delete")
        [pk] = [p for p in (3, 4, 5) if p % 3 == i]
        assert sorted(
            zip(deletes["id"].to_pylist(), deletes["partition_id"].to_pylist(), strict=True)
        ) == sorted((pk, part) for part in docs.partitions)
        assert deletes["segment_id"].null_count == deletes.num_rows
        assert log["msg_type"][-1].as_py() == "timetick"


def test_delete_in_one_partition(producer: Producer, storage: Storage, docs: CollectionInfo) -> None:
    result = producer.delete("docs", np.array([9]), partition="news")

    [(vchannel, appended)] = result.items()
    deletes = of_type(channel_log(storage, docs, vchannel), "delete")
    assert deletes["partition_id"].to_pylist() == [docs.partition_id("news")]
    assert appended.rows == 1


def test_partition_ddl_is_written_to_every_channel_and_recorded_in_meta(
    producer: Producer, storage: Storage, docs: CollectionInfo
) -> None:
    archive = producer.create_partition("docs", "archive")
    producer.insert("docs", generate_rows(SCHEMA, 6), partition="archive")
    dropped = producer.drop_partition("docs", "archive")

    assert dropped == archive
    assert producer.catalog.get(docs.id).partition_names == ("_default", "news")
    for vchannel in docs.vchannels:
        log = channel_log(storage, docs, vchannel)
        ddl = log.filter(pc.is_in(log["msg_type"], pa.array(["create_partition", "drop_partition"])))
        assert ddl["msg_type"].to_pylist() == ["create_partition", "drop_partition"]
        assert ddl["partition_id"].to_pylist() == [archive, archive]
        assert json.loads(ddl["payload"][0].as_py())["partition_name"] == "archive"


def test_drop_collection_writes_its_message_and_drops_its_segments(
    producer: Producer, store: MetaStore, storage: Storage, docs: CollectionInfo
) -> None:
    producer.insert("docs", generate_rows(SCHEMA, 30))

    producer.drop_collection("docs")

    for vchannel in docs.vchannels:
        log = channel_log(storage, docs, vchannel)
        assert log["msg_type"].to_pylist()[-2:] == ["drop_collection", "timetick"]
    assert SegmentMeta(store).list(docs.id) == []  # every one left the live family
    segments = SegmentMeta(store).list(docs.id, include_dropped=True)
    assert segments and all(d.model.state is SegmentState.DROPPED for d in segments)
    assert producer.catalog.find("docs") is None


def test_flush_seals_segments_and_ticks_every_channel_past_the_flush_ts(
    producer: Producer, store: MetaStore, storage: Storage, docs: CollectionInfo
) -> None:
    inserted = producer.insert("docs", generate_rows(SCHEMA, 30))

    flush_ts = producer.flush("docs")

    assert flush_ts > max(r.timestamp for r in inserted.values())
    segments, _ = store.list_models(store.keys.segment.under(docs.id), SegmentInfo)
    assert {(d.model.state, d.model.seal_ts) for d in segments} == {(SegmentState.FLUSHING, flush_ts)}
    for vchannel in docs.vchannels:
        head = WalReader(storage, vchannel, docs).head()
        assert head is not None and head.timestamp > flush_ts
    assert producer.flush_state("docs", flush_ts) is False  # no DataNode synced yet


def test_segments_are_sealed_by_size_as_inserts_arrive(
    store: MetaStore, storage: Storage, settings: Settings
) -> None:
    small = replace(settings, segment_max_size_mb=100 * SCHEMA.row_bytes() / (1 << 20))
    producer = Producer(System(small, store, storage))
    producer.create_collection("small", SCHEMA, num_channels=1)

    producer.insert("small", generate_rows(SCHEMA, 250))

    segments, _ = store.list_models(store.keys.segment.under(producer.collection("small").id), SegmentInfo)
    # Two segments sealed full at 100 rows, the third by the size policy (50 >= 12% of 100).
    assert [d.model.state for d in segments] == [SegmentState.SEALED] * 3
    assert producer.last_sealed[0].reason.startswith("capacity")


def test_a_collection_whose_create_message_was_lost_is_completed_on_first_use(
    system: System, store: MetaStore
) -> None:
    # A crash after the meta was written but before the log: no create message, no start positions.
    info = CollectionRegistry(store).create("half", SCHEMA, num_channels=2)

    completed = Producer(system).collection("half")

    assert len(completed.start_positions) == 2
    for vchannel in info.vchannels:
        assert channel_log(system.storage, info, vchannel)["msg_type"][0].as_py() == "create_collection"


def test_generated_rows_are_deterministic_and_fit_the_schema() -> None:
    a = generate_rows(SCHEMA, 100, start_pk=5, seed=7)

    assert a.equals(generate_rows(SCHEMA, 100, start_pk=5, seed=7))
    assert not a.equals(generate_rows(SCHEMA, 100, start_pk=5, seed=8))
    assert a["id"].to_pylist() == list(range(5, 105))
    assert a["vector"].type == pa.binary(32)
    assert a.column_names == ["id", "vector", "age", "label", "score"]
