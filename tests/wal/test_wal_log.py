"""The write-ahead log on local storage: WalWriter and WalReader against real files."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition
from vchan_assets.storage import Storage
from vchan_assets.wal import (
    CorruptLogError,
    InvalidBatchError,
    LogConflictError,
    SchemaMismatchError,
    UnknownMessageTypeError,
    WalReader,
    WalWriter,
    read_log_file,
)
from vchan_assets.wal.format import log_schema, wal_key

from .helpers import CHANNEL, COLLECTION, SCHEMA, batch, user_rows


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return Storage(str(tmp_path / "storage"))


def test_append_then_read_returns_the_appended_rows(storage: Storage) -> None:
    rows = user_rows(50)
    WalWriter(storage, CHANNEL, COLLECTION).append(batch(rows, ts=1000))

    log = WalReader(storage, CHANNEL, COLLECTION).read()

    assert log.schema.equals(log_schema(SCHEMA))
    inserts = log.filter(pa.compute.equal(log["msg_type"], "insert"))
    pd.testing.assert_frame_equal(inserts.select(rows.column_names).to_pandas(), rows.to_pandas())
    assert log["msg_type"].to_pylist()[-1] == "timetick"
    assert set(inserts["segment_id"].to_pylist()) == {100}


def test_offsets_are_dense_and_continue_across_batches(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)

    spans = [writer.append(batch(user_rows(n), ts=1000 + 10 * i)) for i, n in enumerate((4, 1, 6))]

    assert spans == [(0, 4), (5, 6), (7, 13)]
    reader = WalReader(storage, CHANNEL, COLLECTION)
    assert [f.key for f in reader.files()] == [wal_key(CHANNEL, o) for o in (0, 5, 7)]
    assert reader.read()["offset"].to_pylist() == list(range(14))


def test_a_new_writer_continues_after_the_last_file(storage: Storage) -> None:
    WalWriter(storage, CHANNEL, COLLECTION).append(batch(user_rows(3), ts=1000))
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    writer.refresh()  # forget the in-process cache: read the tail from the last file's footer

    assert writer.next_offset == 4
    assert writer.append(batch(user_rows(2), ts=2000)) == (4, 6)


def test_head_is_the_last_time_tick(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    writer.append(batch(user_rows(3), ts=1000))
    writer.append(batch(user_rows(5), ts=2000))

    assert WalReader(storage, CHANNEL, COLLECTION).head() == MsgPosition(CHANNEL, 9, 2001)


def test_head_ignores_trailing_messages_after_the_last_tick(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    writer.append(batch(user_rows(3), ts=1000))
    writer.append(batch(user_rows(2), ts=2000, tick=False))

    assert WalReader(storage, CHANNEL, COLLECTION).head() == MsgPosition(CHANNEL, 3, 1001)


def test_empty_channel_has_no_head_and_reads_empty(storage: Storage) -> None:
    reader = WalReader(storage, CHANNEL, COLLECTION)

    assert reader.files() == []
    assert reader.head() is None
    assert reader.read().num_rows == 0
    assert reader.read().schema.equals(log_schema(SCHEMA))
    assert WalWriter(storage, CHANNEL, COLLECTION).next_offset == 0


def test_a_leftover_temporary_file_is_not_part_of_the_log(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    writer.append(batch(user_rows(3), ts=1000))
    # What a writer killed between write and rename leaves behind.
    leftover = Path(storage.path(f"wal/{CHANNEL}/.tmp-0123456789abcdef"))
    leftover.write_bytes(b"PAR1 half a batch")
    writer.refresh()

    reader = WalReader(storage, CHANNEL, COLLECTION)
    assert [f.first_offset for f in reader.files()] == [0]
    assert reader.read().num_rows == 4
    assert writer.append(batch(user_rows(1), ts=2000)) == (4, 5)


def test_a_truncated_file_raises_corrupt_log_error_naming_its_path(storage: Storage) -> None:
    WalWriter(storage, CHANNEL, COLLECTION).append(batch(user_rows(20), ts=1000))
    path = Path(storage.path(wal_key(CHANNEL, 0)))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    with pytest.raises(CorruptLogError, match=str(path)):
        WalReader(storage, CHANNEL, COLLECTION).files()
    with pytest.raises(CorruptLogError, match=str(path)):
        read_log_file(storage, wal_key(CHANNEL, 0), SCHEMA)


def test_a_damaged_page_is_detected_by_its_checksum(storage: Storage) -> None:
    WalWriter(storage, CHANNEL, COLLECTION).append(batch(user_rows(2000), ts=1000))
    path = Path(storage.path(wal_key(CHANNEL, 0)))
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the vector column's pages, footer intact
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptLogError, match=str(path)):
        WalReader(storage, CHANNEL, COLLECTION).read()


def test_a_file_whose_name_does_not_match_its_offsets_is_corrupt(storage: Storage) -> None:
    WalWriter(storage, CHANNEL, COLLECTION).append(batch(user_rows(3), ts=1000))
    source = Path(storage.path(wal_key(CHANNEL, 0)))
    moved = Path(storage.path(wal_key(CHANNEL, 4)))
    source.rename(moved)

    with pytest.raises(CorruptLogError, match="the name says 4"):
        WalReader(storage, CHANNEL, COLLECTION).files()


def test_a_missing_file_in_the_middle_is_reported_as_a_gap(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    for i in range(3):
        writer.append(batch(user_rows(2), ts=1000 + 10 * i))
    Path(storage.path(wal_key(CHANNEL, 3))).unlink()

    with pytest.raises(CorruptLogError, match="gap"):
        WalReader(storage, CHANNEL, COLLECTION).files()


def test_appending_a_wrong_column_type_raises_schema_mismatch_and_writes_nothing(storage: Storage) -> None:
    rows = user_rows(3)
    as_lists = rows.set_column(1, "vec", pa.array([[0.0] * 4] * 3, pa.list_(pa.float32())))
    writer = WalWriter(storage, CHANNEL, COLLECTION)

    with pytest.raises(SchemaMismatchError, match="vec"):
        writer.append(batch(as_lists, ts=1000))
    with pytest.raises(SchemaMismatchError, match="unexpected"):
        writer.append(batch(rows, ts=1000).append_column("extra", pa.array([1] * 4)))
    assert WalReader(storage, CHANNEL, COLLECTION).files() == []


def test_reading_a_log_written_with_another_schema_raises_schema_mismatch(storage: Storage) -> None:
    WalWriter(storage, CHANNEL, COLLECTION).append(batch(user_rows(3), ts=1000))
    other = CollectionSchema.build("pk", {"vec": 8}, {"age": "int64", "tag": "string"})

    with pytest.raises(SchemaMismatchError, match="vec"):
        WalReader(storage, CHANNEL, CollectionInfo(1, "c", other, (10,), (CHANNEL,))).read()


def test_an_unknown_message_type_is_rejected_on_append(storage: Storage) -> None:
    bad = batch(user_rows(3), ts=1000).set_column(
        0, "msg_type", pa.array(["insert", "upsert", "insert", "timetick"])
    )

    with pytest.raises(UnknownMessageTypeError, match="'upsert'") as err:
        WalWriter(storage, CHANNEL, COLLECTION).append(bad)
    assert err.value.offset == 1


def test_an_unknown_message_type_in_a_file_raises_on_read(storage: Storage) -> None:
    # A file from another (newer) producer, written directly with pyarrow.
    WalWriter(storage, CHANNEL, COLLECTION).append(batch(user_rows(2), ts=1000))
    path = storage.path(wal_key(CHANNEL, 0))
    table = pq.read_table(path)
    kinds = table["msg_type"].to_pylist()
    kinds[1] = "upsert"
    pq.write_table(table.set_column(1, "msg_type", pa.array(kinds)), path)

    with pytest.raises(UnknownMessageTypeError, match=path):
        WalReader(storage, CHANNEL, COLLECTION).read()


def test_timestamps_must_not_go_backwards(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    writer.append(batch(user_rows(2), ts=2000))

    with pytest.raises(InvalidBatchError, match="timestamps must not decrease"):
        writer.append(batch(user_rows(2), ts=1000))
    assert writer.next_offset == 3


def test_insert_messages_need_a_segment(storage: Storage) -> None:
    rows = batch(user_rows(2), ts=1000)
    no_segment = rows.set_column(2, "segment_id", pa.array([None] * 3, pa.int64()))

    with pytest.raises(InvalidBatchError, match="segment_id"):
        WalWriter(storage, CHANNEL, COLLECTION).append(no_segment)


def test_ranges_select_overlapping_files_and_exact_offsets(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    for i in range(3):  # files [0..4], [5..9], [10..14]
        writer.append(batch(user_rows(4, start=4 * i), ts=1000 + 10 * i))
    reader = WalReader(storage, CHANNEL, COLLECTION)

    assert [f.first_offset for f in reader.files_between(4, 10)] == [5, 10]
    assert [f.first_offset for f in reader.files_between(-1, 0)] == [0]
    assert reader.files_between(14) == []
    assert reader.read(3, 11)["offset"].to_pylist() == list(range(4, 12))
    assert reader.size_between(4, 10) == sum(f.size_bytes for f in reader.files()[1:])


def _damage(storage: Storage, first_offset: int) -> Path:
    path = Path(storage.path(wal_key(CHANNEL, first_offset)))
    path.write_bytes(b"not parquet")
    return path


def test_files_after_a_checkpoint_are_found_without_opening_older_files(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    for i in range(4):  # files [0..4], [5..9], [10..14], [15..19]
        writer.append(batch(user_rows(4, start=4 * i), ts=1000 + 10 * i))
    damaged = _damage(storage, 5)  # already synced: a checkpoint at 9 or later never needs it
    reader = WalReader(storage, CHANNEL, COLLECTION)

    assert [f.first_offset for f in reader.files_between(9)] == [10, 15]
    assert [f.first_offset for f in reader.files_after(12)] == [10, 15]  # a checkpoint inside a file
    assert reader.files_after(19) == []
    assert reader.backlog(9).messages == 10 and reader.backlog(9).head == MsgPosition(CHANNEL, 19, 1031)
    assert [e.path for e in reader.damaged_before(10)] == [str(damaged)]
    with pytest.raises(CorruptLogError, match=str(damaged)):
        reader.files()  # the whole log (garbage collection, checks) still sees it


def test_a_damaged_file_after_the_checkpoint_is_an_error_naming_it(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    for i in range(3):
        writer.append(batch(user_rows(4, start=4 * i), ts=1000 + 10 * i))
    damaged = _damage(storage, 10)

    with pytest.raises(CorruptLogError, match=str(damaged)):
        WalReader(storage, CHANNEL, COLLECTION).files_after(4)
    with pytest.raises(CorruptLogError, match=str(damaged)):
        WalReader(storage, CHANNEL, COLLECTION).files_after(12)  # inside the damaged file


def test_a_missing_file_after_the_checkpoint_is_found_by_the_end_check(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    for i in range(4):
        writer.append(batch(user_rows(2), ts=1000 + 10 * i))
    hole = Path(storage.path(wal_key(CHANNEL, 6)))
    hole.unlink()
    reader = WalReader(storage, CHANNEL, COLLECTION)

    before_hole = reader.files_after(2)  # followed by name up to the hole
    assert [f.first_offset for f in before_hole] == [3]
    with pytest.raises(CorruptLogError, match="gap: no file starts at offset 6"):
        reader.check_end(before_hole[-1].end_offset)  # what `vchan status` checks


def test_storage_lists_keys_after_a_start_key_without_temporary_files(storage: Storage) -> None:
    for name in ("b", "a", "c", ".tmp-x"):
        storage.write_atomic(f"dir/{name}", b"1")
    storage.write_atomic("dir/sub/d", b"1")

    assert storage.list_keys("dir/") == ["dir/a", "dir/b", "dir/c"]
    assert storage.list_keys("dir/", start_after="dir/a") == ["dir/b", "dir/c"]
    assert storage.list_keys("missing/") == []


def test_backlog_after_a_checkpoint_counts_messages_bytes_and_age(storage: Storage) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    writer.append(batch(user_rows(4), ts=1000))
    writer.append(batch(user_rows(4), ts=2000))
    reader = WalReader(storage, CHANNEL, COLLECTION)

    backlog = reader.backlog(after_offset=2)

    assert backlog.messages == 7  # offsets 3..9
    assert backlog.files == 2
    assert backlog.oldest_timestamp == 1000
    assert backlog.size_bytes == sum(f.size_bytes for f in reader.files())
    assert backlog.head == MsgPosition(CHANNEL, 9, 2001)
    assert reader.backlog(after_offset=9).messages == 0


def test_a_second_producer_never_overwrites_a_log_file(storage: Storage, tmp_path: Path) -> None:
    writer = WalWriter(storage, CHANNEL, COLLECTION)
    writer.append(batch(user_rows(2), ts=1000))  # offsets 0..2; the writer caches next = 3
    # Another producer (another process) appends offsets 3..5 behind this writer's back.
    elsewhere = Storage(str(tmp_path / "elsewhere"))
    other = WalWriter(elsewhere, CHANNEL, COLLECTION)
    other.append(batch(user_rows(2), ts=1000))
    other.append(batch(user_rows(2), ts=2000))
    theirs = Path(elsewhere.path(wal_key(CHANNEL, 3))).read_bytes()
    Path(storage.path(wal_key(CHANNEL, 3))).write_bytes(theirs)

    with pytest.raises(LogConflictError, match=CHANNEL):
        writer.append(batch(user_rows(2), ts=3000))
    assert Path(storage.path(wal_key(CHANNEL, 3))).read_bytes() == theirs
    assert writer.append(batch(user_rows(2), ts=3000)) == (6, 8)  # after re-reading the tail
