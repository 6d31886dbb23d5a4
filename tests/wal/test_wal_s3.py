"""The write-ahead log on S3: the same code path against a real S3-compatible server."""

from __future__ import annotations

import uuid

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition
from vchan_assets.storage import Storage
from vchan_assets.wal import CorruptLogError, WalReader, WalWriter
from vchan_assets.wal.format import wal_key
from vchan_assets.wal.producer import generate_rows

CHANNEL = "s3-dml_0_7v0"
SCHEMA = CollectionSchema.build("pk", {"vec": 16}, {"age": "int64", "tag": "string"})
COLLECTION = CollectionInfo(7, "s3", SCHEMA, (70,), (CHANNEL,), partition_names=("_default",))


@pytest.fixture
def s3_storage(s3_server: dict[str, str]) -> Storage:
    return Storage(f"s3://{s3_server['bucket']}/{uuid.uuid4().hex[:8]}", s3_endpoint=s3_server["endpoint"])


def insert_batch(rows: pa.Table, ts: int) -> pa.Table:
    n = rows.num_rows
    inserts = pa.table(
        {
            "msg_type": ["insert"] * n,
            "timestamp": pa.array([ts] * n, pa.int64()),
            "segment_id": pa.array([1] * n, pa.int64()),
            "partition_id": pa.array([70] * n, pa.int64()),
            **{name: rows.column(name) for name in rows.column_names},
        }
    )
    tick = pa.table({"msg_type": ["timetick"], "timestamp": pa.array([ts + 1], pa.int64())})
    return pa.concat_tables([inserts, tick], promote_options="default")


def test_wal_round_trip_on_s3(s3_storage: Storage) -> None:
    first, second = generate_rows(SCHEMA, 300, 0, seed=1), generate_rows(SCHEMA, 200, 300, seed=2)
    writer = WalWriter(s3_storage, CHANNEL, COLLECTION)

    assert writer.append(insert_batch(first, ts=1000)) == (0, 300)
    assert writer.append(insert_batch(second, ts=2000)) == (301, 501)

    reader = WalReader(s3_storage, CHANNEL, COLLECTION)
    assert [f.key for f in reader.files()] == [wal_key(CHANNEL, 0), wal_key(CHANNEL, 301)]
    assert reader.head() == MsgPosition(CHANNEL, 501, 2001)
    log = reader.read()
    inserts = log.filter(pc.equal(log["msg_type"], "insert")).select(first.column_names)
    pd.testing.assert_frame_equal(inserts.to_pandas(), pa.concat_tables([first, second]).to_pandas())
    # Only whole objects: a single PUT per batch, no temporary names on S3.
    names = [info.base_name for info in s3_storage.list_files("wal/")]
    assert names == [wal_key(CHANNEL, 0).rsplit("/", 1)[1], wal_key(CHANNEL, 301).rsplit("/", 1)[1]]


def test_a_new_writer_on_s3_continues_from_the_last_object(s3_storage: Storage) -> None:
    WalWriter(s3_storage, CHANNEL, COLLECTION).append(insert_batch(generate_rows(SCHEMA, 10), ts=1000))
    writer = WalWriter(s3_storage, CHANNEL, COLLECTION)
    writer.refresh()

    assert writer.append(insert_batch(generate_rows(SCHEMA, 5, 10), ts=2000)) == (11, 16)


def test_a_truncated_object_on_s3_is_corrupt(s3_storage: Storage) -> None:
    WalWriter(s3_storage, CHANNEL, COLLECTION).append(insert_batch(generate_rows(SCHEMA, 50), ts=1000))
    key = wal_key(CHANNEL, 0)
    data = s3_storage.read_bytes(key)
    s3_storage.write_atomic(key, data[:100])

    with pytest.raises(CorruptLogError, match=s3_storage.path(key)):
        WalReader(s3_storage, CHANNEL, COLLECTION).files()


def test_s3_lists_keys_from_a_start_key_and_a_sync_reads_only_what_follows(s3_storage: Storage) -> None:
    writer = WalWriter(s3_storage, CHANNEL, COLLECTION)
    for i in range(3):  # objects [0..10], [11..21], [22..32]
        writer.append(insert_batch(generate_rows(SCHEMA, 10, 10 * i), ts=1000 * (i + 1)))
    s3_storage.write_atomic(wal_key(CHANNEL, 0), b"damaged")  # below a checkpoint at 21
    prefix = f"wal/{CHANNEL}/"

    assert s3_storage.list_keys(prefix) == [wal_key(CHANNEL, o) for o in (0, 11, 22)]
    assert s3_storage.list_keys(prefix, start_after=wal_key(CHANNEL, 11)) == [wal_key(CHANNEL, 22)]
    reader = WalReader(s3_storage, CHANNEL, COLLECTION)
    assert [f.first_offset for f in reader.files_after(21)] == [22]
    assert reader.backlog(21).head == MsgPosition(CHANNEL, 32, 3001)
    assert [e.path for e in reader.damaged_before(22)] == [s3_storage.path(wal_key(CHANNEL, 0))]


def test_a_hole_after_the_checkpoint_on_s3_stops_the_reader_with_a_gap(s3_storage: Storage) -> None:
    writer = WalWriter(s3_storage, CHANNEL, COLLECTION)
    for i in range(4):  # objects [0..10], [11..21], [22..32], [33..43]
        writer.append(insert_batch(generate_rows(SCHEMA, 10, 10 * i), ts=1000 * (i + 1)))
    s3_storage.delete(wal_key(CHANNEL, 22))

    with pytest.raises(CorruptLogError, match="gap: no file starts at offset 22"):
        WalReader(s3_storage, CHANNEL, COLLECTION).files_after(10)
