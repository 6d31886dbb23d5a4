"""Values already in etcd keep decoding, and records encode to the same JSON.

The byte strings below were written by the hand-written `to_dict` of each record before
the generic codec replaced it; they stand for keys that live clusters hold today.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from vchan_assets.meta.codec import decode, encode, immutable
from vchan_assets.meta.errors import MalformedValueError
from vchan_assets.model import (
    Binlog,
    ChannelLease,
    ChannelWatchInfo,
    CollectionInfo,
    CollectionSchema,
    ColumnGroupBinlogs,
    MsgPosition,
    NodeSession,
    Record,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    SessionState,
    VchannelInfo,
    WatchState,
)

POS = MsgPosition("by-dev-ch_0", 41, 449_000_000_000_000_000)
SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "s": "string"})

STORED = [
    (
        b'{"v":1,"channel":"by-dev-ch_0","offset":41,"timestamp":449000000000000000}',
        POS,
    ),
    (
        b'{"v":1,"id":7,"name":"books","schema":{"fields":[{"field_id":100,"name":"pk","dtype":"int64",'
        b'"is_primary":true},{"field_id":101,"name":"vec","dtype":"float_vector","is_primary":false,"dim":8},'
        b'{"field_id":102,"name":"n","dtype":"int64","is_primary":false},{"field_id":103,"name":"s",'
        b'"dtype":"string","is_primary":false}]},"partitions":[8,9],"partition_names":["_default","p1"],'
        b'"vchannels":["by-dev-ch_0","by-dev-ch_1"],"start_positions":[{"channel":"by-dev-ch_0","offset":41,'
        b'"timestamp":449000000000000000},{"channel":"by-dev-ch_1","offset":-1,"timestamp":5}],'
        b'"created_at":1700000000.5,"dropped_at":0.0}',
        CollectionInfo(
            7, "books", SCHEMA, (8, 9), ("by-dev-ch_0", "by-dev-ch_1"),
            (POS, MsgPosition("by-dev-ch_1", -1, 5)), 1700000000.5, ("_default", "p1"), 0.0,
        ),
    ),
    (
        b'{"v":1,"id":12,"collection_id":7,"partition_id":8,"vchannel":"by-dev-ch_0","state":"Flushed",'
        b'"level":"L1","num_rows":300,"max_rows":1000,"binlogs":[{"group":0,"field_ids":[0,1,100,102,103],'
        b'"logs":[{"log_id":101,"path":"insert_log/7/8/12/0/101.parquet","entries":300,"ts_from":10,'
        b'"ts_to":20,"size_bytes":4096}]},{"group":1,"field_ids":[101],"logs":[{"log_id":102,'
        b'"path":"insert_log/7/8/12/1/102.parquet","entries":300,"ts_from":10,"ts_to":20,'
        b'"size_bytes":9999}]}],"deltalogs":[{"log_id":103,"path":"delta_log/7/8/12/103.parquet",'
        b'"entries":2,"ts_from":11,"ts_to":12,"size_bytes":100}],"statslogs":[{"log_id":104,'
        b'"path":"stats_log/7/8/12/104","entries":300,"ts_from":10,"ts_to":20,"size_bytes":64}],'
        b'"start_position":{"channel":"by-dev-ch_0","offset":3,"timestamp":10},"dml_position":'
        b'{"channel":"by-dev-ch_0","offset":41,"timestamp":449000000000000000},"compaction_from":[4,5],'
        b'"is_sorted":true,"last_flush_ts":449000000000000000,"created_at":1700000001.0,'
        b'"last_insert_at":1700000002.0,"seal_ts":449000000000000001}',
        SegmentInfo(
            12, 7, 8, "by-dev-ch_0", SegmentState.FLUSHED, SegmentLevel.L1, 300, 1000,
            (
                ColumnGroupBinlogs(
                    0, (0, 1, 100, 102, 103), (Binlog(101, "insert_log/7/8/12/0/101.parquet", 300, 10, 20, 4096),)
                ),
                ColumnGroupBinlogs(1, (101,), (Binlog(102, "insert_log/7/8/12/1/102.parquet", 300, 10, 20, 9999),)),
            ),
            (Binlog(103, "delta_log/7/8/12/103.parquet", 2, 11, 12, 100),),
            (Binlog(104, "stats_log/7/8/12/104", 300, 10, 20, 64),),
            MsgPosition("by-dev-ch_0", 3, 10), POS, (4, 5), True, 449_000_000_000_000_000,
            1700000001.0, 1700000002.0, 449_000_000_000_000_001,
        ),
    ),
    (
        b'{"v":1,"id":13,"collection_id":7,"partition_id":9,"vchannel":"by-dev-ch_1","state":"Growing",'
        b'"level":"L1","num_rows":0,"max_rows":0,"binlogs":[],"deltalogs":[],"statslogs":[],'
        b'"start_position":null,"dml_position":null,"compaction_from":[],"is_sorted":false,'
        b'"last_flush_ts":0,"created_at":0.0,"last_insert_at":0.0,"seal_ts":0}',
        SegmentInfo(13, 7, 9, "by-dev-ch_1", SegmentState.GROWING),
    ),
    (
        b'{"v":1,"node_id":3,"address":"127.0.0.1:3","version":"0.1.0","started_at":1700000000.25,'
        b'"state":"INITIALIZING"}',
        NodeSession(3, "127.0.0.1:3", "0.1.0", 1700000000.25, SessionState.INITIALIZING),
    ),
    (
        b'{"v":1,"lease_id":55,"node_id":3,"granted_at":1700000003.0}',
        ChannelLease(55, 3, 1700000003.0),
    ),
    (
        b'{"v":1,"vchan":{"collection_id":7,"channel_name":"by-dev-ch_0","seek_position":{"channel":'
        b'"by-dev-ch_0","offset":41,"timestamp":449000000000000000},"unflushed_segment_ids":[12],'
        b'"flushed_segment_ids":[11],"dropped_segment_ids":[10]},"state":"ToWatch","start_ts":1700000004.0,'
        b'"timeout_ts":1700000304.0,"progress":10,"op_id":99,"lease_id":55,"reason":""}',
        ChannelWatchInfo(
            VchannelInfo(7, "by-dev-ch_0", POS, (12,), (11,), (10,)), WatchState.TO_WATCH,
            1700000004.0, 1700000304.0, 10, 99, 55, "",
        ),
    ),
    (
        b'{"v":1,"vchan":{"collection_id":7,"channel_name":"by-dev-ch_1","seek_position":null,'
        b'"unflushed_segment_ids":[],"flushed_segment_ids":[],"dropped_segment_ids":[]},"state":'
        b'"WatchSuccess","start_ts":1.0,"timeout_ts":2.0,"progress":0,"op_id":0,"lease_id":null,"reason":""}',
        ChannelWatchInfo(VchannelInfo(7, "by-dev-ch_1"), WatchState.WATCH_SUCCESS, 1.0, 2.0),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "record"), STORED, ids=lambda x: type(x).__name__)
def test_a_value_written_before_decodes_to_the_same_record(raw: bytes, record: object) -> None:
    assert decode("k", raw, type(record)) == record


# A segment is now written without the binlog paths the layout derives (STORED[2] as
# written today): the same record, 150 bytes (15%) fewer.
WRITTEN_NOW = {
    STORED[2][0]: (
        b'{"v":1,"id":12,"collection_id":7,"partition_id":8,"vchannel":"by-dev-ch_0","state":"Flushed",'
        b'"level":"L1","num_rows":300,"max_rows":1000,"binlogs":[{"group":0,"field_ids":[0,1,100,102,103],'
        b'"logs":[{"log_id":101,"entries":300,"ts_from":10,"ts_to":20,"size_bytes":4096}]},{"group":1,'
        b'"field_ids":[101],"logs":[{"log_id":102,"entries":300,"ts_from":10,"ts_to":20,"size_bytes":9999}]}],'
        b'"deltalogs":[{"log_id":103,"entries":2,"ts_from":11,"ts_to":12,"size_bytes":100}],"statslogs":'
        b'[{"log_id":104,"entries":300,"ts_from":10,"ts_to":20,"size_bytes":64}],'
        b'"start_position":{"channel":"by-dev-ch_0","offset":3,"timestamp":10},"dml_position":'
        b'{"channel":"by-dev-ch_0","offset":41,"timestamp":449000000000000000},"compaction_from":[4,5],'
        b'"is_sorted":true,"last_flush_ts":449000000000000000,"created_at":1700000001.0,'
        b'"last_insert_at":1700000002.0,"seal_ts":449000000000000001}'
    ),
}  # fmt: skip


@pytest.mark.parametrize(("raw", "record"), STORED, ids=lambda x: type(x).__name__)
def test_a_record_encodes_to_the_same_json_as_before(raw: bytes, record: object) -> None:
    expected = WRITTEN_NOW.get(raw, raw)
    assert json.loads(encode(record)) == json.loads(expected)  # type: ignore[arg-type]


def test_a_segment_written_without_derived_paths_decodes_with_them() -> None:
    raw, record = STORED[2]

    assert decode("k", WRITTEN_NOW[raw], SegmentInfo) == record
    assert len(encode(record)) == len(WRITTEN_NOW[raw]) < len(raw)  # type: ignore[arg-type]


def test_a_binlog_path_the_layout_does_not_derive_is_kept() -> None:
    imported = Binlog(201, "imports/job-3/part-0.parquet", 10, 1, 2, 64)
    older = Binlog(202, "insert_log/7/8/12/0/202", 10, 1, 2, 64)  # no suffix: another layout
    other_segment = Binlog(203, "delta_log/7/8/11/203.parquet", 2, 1, 2, 64)  # an input's file
    derived = Binlog(204, "insert_log/7/8/12/0/204.parquet", 10, 1, 2, 64)
    seg = SegmentInfo(
        12, 7, 8, "c", SegmentState.FLUSHED,
        binlogs=(ColumnGroupBinlogs(0, (0, 1, 100), (imported, older, derived)),),
        deltalogs=(other_segment,),
    )  # fmt: skip

    body = json.loads(encode(seg))

    assert [b.get("path") for b in body["binlogs"][0]["logs"]] == [imported.path, older.path, None]
    assert body["deltalogs"][0]["path"] == other_segment.path
    assert decode("k", encode(seg), SegmentInfo) == seg


def test_a_binlog_without_path_in_a_segment_of_no_ids_is_named_in_the_error() -> None:
    raw = json.loads(WRITTEN_NOW[STORED[2][0]])
    del raw["collection_id"]

    with pytest.raises(MalformedValueError) as bad:
        decode("seg", json.dumps(raw).encode(), SegmentInfo)

    assert "seg" in str(bad.value) and "missing field" in str(bad.value)


def test_optional_fields_written_by_older_versions_may_be_missing() -> None:
    raw = b'{"v":1,"id":13,"collection_id":7,"partition_id":9,"vchannel":"c","state":"Growing"}'

    assert decode("k", raw, SegmentInfo) == SegmentInfo(13, 7, 9, "c", SegmentState.GROWING)


def test_a_segment_written_before_is_invisible_existed_decodes_as_visible() -> None:
    raw = b'{"v":1,"id":13,"collection_id":7,"partition_id":9,"vchannel":"c","state":"Flushed"}'

    assert decode("k", raw, SegmentInfo).is_invisible is False


def test_is_invisible_is_written_only_when_set() -> None:
    visible = SegmentInfo(13, 7, 9, "c", SegmentState.FLUSHED)
    invisible = SegmentInfo(13, 7, 9, "c", SegmentState.FLUSHED, is_invisible=True)

    assert "is_invisible" not in json.loads(encode(visible))
    assert json.loads(encode(invisible))["is_invisible"] is True
    assert decode("k", encode(invisible), SegmentInfo) == invisible


def test_dropped_ts_is_written_only_when_a_compaction_stamped_it() -> None:
    dropped = SegmentInfo(13, 7, 9, "c", SegmentState.DROPPED, dropped_at=1700000000.5)
    stamped = SegmentInfo(13, 7, 9, "c", SegmentState.DROPPED, dropped_at=1700000000.5, dropped_ts=1 << 40)

    assert "dropped_ts" not in json.loads(encode(dropped))
    assert decode("k", encode(stamped), SegmentInfo) == stamped


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"v":1,"channel":"c","offset":"41","timestamp":1}', "field 'offset' must be int, got str"),
        (b'{"v":1,"channel":"c","offset":-2,"timestamp":1}', "field 'offset' must be >= -1"),
        (b'{"v":1,"channel":"c","timestamp":1}', "missing field 'offset'"),
        (b'{"v":1,"channel":"c","offset":true,"timestamp":1}', "field 'offset' must be int, got bool"),
    ],
)
def test_a_bad_field_is_named_in_the_error(raw: bytes, message: str) -> None:
    with pytest.raises(MalformedValueError) as bad:
        decode("vchan/meta/channel-cp/c", raw, MsgPosition)

    assert message in str(bad.value) and "vchan/meta/channel-cp/c" in str(bad.value)


def test_a_bad_nested_record_names_its_path() -> None:
    raw = json.loads(STORED[2][0])
    raw["binlogs"][1]["logs"][0]["entries"] = "many"

    with pytest.raises(MalformedValueError) as bad:
        decode("seg", json.dumps(raw).encode(), SegmentInfo)

    assert "in binlogs[1]: in logs[0]: field 'entries' must be int" in str(bad.value)


def test_an_unknown_state_lists_the_allowed_ones() -> None:
    raw = STORED[7][0].replace(b'"WatchSuccess"', b'"Watching"')

    with pytest.raises(MalformedValueError) as bad:
        decode("w", raw, ChannelWatchInfo)

    assert "field 'state' is 'Watching', expected one of: ToWatch" in str(bad.value)


def test_the_same_bytes_decode_once_and_a_malformed_value_raises_every_time() -> None:
    from vchan_assets.meta.codec import _decoded

    raw = encode(ChannelLease(lease_id=7, node_id=3, granted_at=11.0))
    before = _decoded.cache_info().hits
    first = decode("k", raw, ChannelLease)
    again = decode("k", raw, ChannelLease)
    assert again is first and again.lease_id == 7
    assert _decoded.cache_info().hits == before + 1
    changed = decode("k", encode(ChannelLease(lease_id=8, node_id=3, granted_at=12.0)), ChannelLease)
    assert changed.lease_id == 8, "new bytes under the same key decode anew"
    for _ in range(2):
        with pytest.raises(MalformedValueError):
            decode("k", b'{"v": 1, "node_id": 3}', ChannelLease)


@dataclass
class _Counter(Record):
    """A record that can change after decoding (not frozen): it must never be shared."""

    n: int


@dataclass(frozen=True)
class _Labelled(Record):
    label: str
    counter: _Counter | None = None


def test_a_record_that_could_change_is_decoded_anew_for_each_caller() -> None:
    raw = b'{"v": 1, "n": 1}'
    first = decode("k", raw, _Counter)
    first.n = 2  # a caller changing what it was given
    assert decode("k", raw, _Counter).n == 1, "another caller saw the change"
    assert not immutable(_Counter) and not immutable(_Labelled), "a frozen record holding a mutable one"
    nested = b'{"v": 1, "label": "a", "counter": {"n": 1}}'
    assert decode("k", nested, _Labelled) is not decode("k", nested, _Labelled)
    assert immutable(ChannelWatchInfo) and decode("k", raw, _Counter) == _Counter(1)


def test_every_stored_record_is_immutable_so_the_codec_caches_it() -> None:
    import vchan_assets.imports.jobs as jobs
    import vchan_assets.lifecycle.plans as plans
    import vchan_assets.model as model

    stored = [
        c
        for module in (model, jobs, plans)
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, Record) and c is not Record
    ]
    assert len(stored) > 20 and SegmentInfo in stored
    assert [c.__name__ for c in stored if not immutable(c)] == []
