"""Log format versions on real files: a format-2 batch (system columns in the log file,
the inserts' columns in a data file written before the offset is known) reads like a
format-1 batch, format-1 files written by earlier versions stay readable next to it, and
what cannot be read is refused naming the file."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vchan_assets.storage import Storage
from vchan_assets.wal import CorruptLogError, InvalidBatchError, WalReader, WalWriter, read_log_file
from vchan_assets.wal.format import SYSTEM_SCHEMA, wal_key
from vchan_assets.wal.writer import DataFile

from .helpers import CHANNEL, COLLECTION, SCHEMA, batch, user_rows

# Written by the format-1 writer (before data files existed): 3 inserts of user_rows(3)
# at ts 100 (segment 100, partition 10) and a time tick at 101, offsets 0-3.
FORMAT_1_FILE = Path(__file__).parent / "data" / "format1-test-dml_0_1v0-00000000000000000000.parquet"
SYSTEM = [n for n in SYSTEM_SCHEMA.names if n != "offset"]


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return Storage(str(tmp_path / "storage"))


def append_format_2(writer: WalWriter, rows: pa.Table, first: int, ts: int) -> DataFile:
    """What the producer does: the data file, then the log file at `first`."""
    batch_id = uuid.uuid4().hex
    data = writer.write_data(rows, batch_id)
    writer.write_at(batch(rows, ts).select(SYSTEM[:-1]), first, ts - 1, batch_id, data)
    return data


def test_a_format_1_file_reads_as_before_and_the_log_continues_in_format_2(storage: Storage) -> None:
    key = wal_key(CHANNEL, 0)
    Path(storage.path(key)).parent.mkdir(parents=True)
    shutil.copy(FORMAT_1_FILE, storage.path(key))
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    append_format_2(writer, user_rows(4, start=3), first=4, ts=200)

    reader = WalReader(storage, CHANNEL, COLLECTION)
    old, new = reader.files()
    assert (old.first_offset, old.count, old.last_timestamp, old.data_key) == (0, 4, 101, None)
    assert (new.first_offset, new.count, new.last_timestamp) == (4, 5, 201) and new.data_key
    log = reader.read()
    assert log["offset"].to_pylist() == list(range(9))
    assert log["msg_type"].to_pylist() == ["insert"] * 3 + ["timetick"] + ["insert"] * 4 + ["timetick"]
    assert log["timestamp"].to_pylist() == [100] * 3 + [101] + [200] * 4 + [201]
    inserts = log.filter(pa.compute.equal(log["msg_type"], "insert"))
    want = pa.concat_tables([user_rows(3), user_rows(4, start=3)])
    assert inserts.select(want.column_names).equals(want)
    assert log.slice(8)["pk"].to_pylist() == [None], "the tick has no data"
    assert reader.head() is not None and reader.head().offset == 8


def test_a_format_2_batch_reads_exactly_like_the_same_batch_in_format_1(
    storage: Storage, tmp_path: Path
) -> None:
    rows = user_rows(50)
    append_format_2(WalWriter(storage, CHANNEL, COLLECTION), rows, first=0, ts=1000)
    old = Storage(str(tmp_path / "format1"))
    WalWriter(old, CHANNEL, COLLECTION).append(batch(rows, ts=1000))

    for columns in (None, ["segment_id"], ["pk", "tag"]):
        want = read_log_file(old, wal_key(CHANNEL, 0), SCHEMA, columns)
        assert read_log_file(storage, wal_key(CHANNEL, 0), SCHEMA, columns).equals(want)
    [f] = WalReader(storage, CHANNEL, COLLECTION).files()
    assert f.data_bytes == Path(storage.path(f.data_key or "")).stat().st_size
    assert f.size_bytes == f.data_bytes + Path(storage.path(f.key)).stat().st_size


def test_a_missing_data_file_is_corrupt_naming_both_files(storage: Storage) -> None:
    data = append_format_2(WalWriter(storage, CHANNEL, COLLECTION), user_rows(5), first=0, ts=1000)
    Path(storage.path(data.key)).unlink()

    # what needs no data columns (head, offsets, segments) reads without it
    assert read_log_file(storage, wal_key(CHANNEL, 0), SCHEMA, ["segment_id"]).num_rows == 6
    with pytest.raises(CorruptLogError, match="data file .* is missing") as raised:
        WalReader(storage, CHANNEL, COLLECTION).read()
    assert raised.value.path == storage.path(wal_key(CHANNEL, 0))
    assert storage.path(data.key) in str(raised.value)


def test_a_log_file_of_a_newer_format_is_refused_naming_the_version(storage: Storage) -> None:
    table = pq.read_table(FORMAT_1_FILE)
    newer = table.replace_schema_metadata({**table.schema.metadata, b"vchan.format": b"3"})
    key = wal_key(CHANNEL, 0)
    Path(storage.path(key)).parent.mkdir(parents=True)
    pq.write_table(newer, storage.path(key))

    with pytest.raises(CorruptLogError, match="written in log format 3; this version reads formats 1 to 2"):
        WalReader(storage, CHANNEL, COLLECTION).files()
    with pytest.raises(CorruptLogError, match="log format 3"):
        read_log_file(storage, key, SCHEMA)


def test_a_format_2_batch_whose_inserts_do_not_match_its_data_file_is_rejected(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    data = writer.write_data(user_rows(3), "b1")
    with pytest.raises(InvalidBatchError, match="inserts must be the first 3 messages"):
        writer.write_at(batch(user_rows(2), 10).select(SYSTEM[:-1]), 0, 0, "b1", data)
    nulls = user_rows(3).set_column(2, "age", pa.array([1, None, 3], pa.int64()))
    with pytest.raises(InvalidBatchError, match="insert messages need 'age'"):
        writer.write_data(nulls, "b2")
    assert WalReader(storage, CHANNEL, COLLECTION).files() == []
