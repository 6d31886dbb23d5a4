"""The metastore against a real etcd: CAS, lease-guarded commits, malformed values, outages."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta import store as store_module
from vchan_assets.meta.codec import decode, encode
from vchan_assets.meta.embedded import EmbeddedEtcd, free_port
from vchan_assets.meta.errors import (
    CasConflictError,
    LeaseLostError,
    MalformedValueError,
    MetaError,
    MetaUnavailableError,
    RevisionCompactedError,
    TransactionTooLargeError,
    ValueTooLargeError,
)
from vchan_assets.meta.store import MAX_REQUEST_BYTES, MAX_TXN_OPS, MAX_VALUE_BYTES, KeyValue, MetaStore
from vchan_assets.model import ChannelLease, MsgPosition
from vchan_assets.testing.steps import requests
from vchan_assets.testing.waiting import wait_until


@pytest.fixture
def other_store(settings: Settings) -> Iterator[MetaStore]:
    """A second, independent client of the same etcd and key root (another process)."""
    meta = MetaStore.connect(settings)
    yield meta
    meta.close()


def _grant_channel_lease(store: MetaStore, channel: str, lease_id: int, node_id: int) -> ChannelLease:
    lease = ChannelLease(lease_id=lease_id, node_id=node_id, granted_at=time.time())
    store.put(store.keys.channel_lease(channel), lease)
    return lease


# --- compare-and-swap -------------------------------------------------------------------


def test_cas_between_two_writers_lets_exactly_one_win(store: MetaStore, other_store: MetaStore) -> None:
    key = store.keys.channel_watch(1, "ch-0")
    store.put(key, {"state": "ToWatch"})
    read_by_first = store.get(key)
    read_by_second = other_store.get(key)
    assert read_by_first is not None and read_by_second is not None

    store.cas(key, read_by_first.version, {"state": "WatchSuccess"})
    with pytest.raises(CasConflictError) as lost:
        other_store.cas(key, read_by_second.version, {"state": "WatchFailure"})

    assert lost.value.key == key
    assert lost.value.expected_version == read_by_second.version
    assert lost.value.found_version == read_by_second.version + 1
    final = store.get(key)
    assert final is not None and b"WatchSuccess" in final.value


def test_cas_on_version_zero_creates_only_if_absent(store: MetaStore, other_store: MetaStore) -> None:
    key = store.keys.channel_watch(1, "ch-new")
    store.cas(key, 0, {"owner": "first"})
    with pytest.raises(CasConflictError) as lost:
        other_store.cas(key, 0, {"owner": "second"})
    assert lost.value.found_version == 1
    kv = store.get(key)
    assert kv is not None and b"first" in kv.value


# --- lease-guarded transactions ---------------------------------------------------------


def test_guarded_txn_rejects_a_stale_writer_and_writes_nothing(store: MetaStore) -> None:
    channel = "by-dev-rootcoord-dml_0_100v0"
    stale = _grant_channel_lease(store, channel, lease_id=7, node_id=1)
    _grant_channel_lease(store, channel, lease_id=8, node_id=2)  # reassigned to node 2
    segment_key = store.keys.segment(100, 1, 42)
    checkpoint_key = store.keys.channel_checkpoint(channel)

    with pytest.raises(LeaseLostError) as lost:
        store.guarded_txn(
            channel,
            stale,
            puts={segment_key: {"id": 42}, checkpoint_key: MsgPosition(channel, 10, 99)},
        )

    assert (lost.value.channel, lost.value.expected, lost.value.found) == (channel, 7, 8)
    assert channel in str(lost.value) and "nothing was committed" in str(lost.value)
    assert store.get(segment_key) is None
    assert store.get(checkpoint_key) is None


def test_guarded_txn_rejects_a_writer_whose_lease_was_removed(store: MetaStore) -> None:
    channel = "ch-released"
    stale = _grant_channel_lease(store, channel, lease_id=9, node_id=1)
    store.delete(store.keys.channel_lease(channel))
    segment_key = store.keys.segment(100, 1, 43)

    with pytest.raises(LeaseLostError) as lost:
        store.guarded_txn(channel, stale, puts={segment_key: {"id": 43}})

    assert lost.value.found is None
    assert store.get(segment_key) is None


def test_guarded_txn_with_a_changed_segment_version_raises_conflict_and_writes_nothing(
    store: MetaStore,
) -> None:
    channel = "ch-versions"
    lease = _grant_channel_lease(store, channel, lease_id=11, node_id=1)
    segment_key = store.keys.segment(100, 1, 44)
    store.put(segment_key, {"id": 44, "num_rows": 1})
    read = store.get(segment_key)
    assert read is not None
    store.put(segment_key, {"id": 44, "num_rows": 5})  # a concurrent writer (e.g. compaction)
    checkpoint_key = store.keys.channel_checkpoint(channel)

    with pytest.raises(CasConflictError) as conflict:
        store.guarded_txn(
            channel,
            lease,
            puts={segment_key: {"id": 44, "num_rows": 2}, checkpoint_key: MsgPosition(channel, 3, 9)},
            expect_versions={segment_key: read.version},
        )

    assert conflict.value.key == segment_key
    assert (conflict.value.expected_version, conflict.value.found_version) == (read.version, read.version + 1)
    assert store.get(checkpoint_key) is None
    current = store.get(segment_key)
    assert current is not None and b'"num_rows":5' in current.value


def test_guarded_txn_commits_everything_while_the_lease_holds(store: MetaStore) -> None:
    channel = "ch-ok"
    lease = _grant_channel_lease(store, channel, lease_id=12, node_id=1)
    segment_key = store.keys.segment(100, 1, 45)
    checkpoint_key = store.keys.channel_checkpoint(channel)

    revision = store.guarded_txn(
        channel,
        lease,
        puts={segment_key: {"id": 45}, checkpoint_key: MsgPosition(channel, 3, 9)},
        expect_versions={segment_key: 0},
    )

    segment, checkpoint = store.get(segment_key), store.get(checkpoint_key)
    assert segment is not None and checkpoint is not None
    assert segment.mod_revision == checkpoint.mod_revision == revision


# --- malformed values -------------------------------------------------------------------


def test_a_txn_unchanged_since_a_listing_fails_once_a_key_under_its_prefix_was_written(
    store: MetaStore,
) -> None:
    root = store.keys.root
    store.put(f"{root}/range/a/1", b"x")
    revision = store.list_prefix(f"{root}/range/a/").revision
    store.put(f"{root}/range/b/1", b"y")  # another prefix: no matter
    assert store.txn_unchanged_since(revision, [f"{root}/range/a/"], {f"{root}/range/a/2": b"z"}) is not None

    revision = store.list_prefix(f"{root}/range/a/").revision
    store.put(f"{root}/range/a/3", b"w")  # added after the listing

    assert store.txn_unchanged_since(revision, [f"{root}/range/a/"], {f"{root}/range/a/4": b"v"}) is None
    assert store.get(f"{root}/range/a/4") is None
    empty = store.list_prefix(f"{root}/range/c/").revision  # an empty range holds
    assert store.txn_unchanged_since(empty, [f"{root}/range/c/"], {f"{root}/range/c/1": b"u"}) is not None


def test_list_prefixes_reads_every_prefix_in_key_order_at_one_revision(store: MetaStore) -> None:
    root = store.keys.root
    for key in ("many/b/2", "many/a/2", "many/a/1", "many/a1"):
        store.put(f"{root}/{key}", key.encode())
    revision = store.put(f"{root}/many/a/1", b"again")  # the newest write: the revision of the read

    a, b, empty = store.list_prefixes([f"{root}/many/a/", f"{root}/many/b/", f"{root}/many/c/"])

    assert [kv.key for kv in a] == [f"{root}/many/a/1", f"{root}/many/a/2"], "a1 is not under a/"
    assert a[0].value == b"again" and a[0].version == 2 and a[0].mod_revision == revision
    assert [kv.value for kv in b] == [b"many/b/2"] and empty == []
    assert a == store.list_prefix(f"{root}/many/a/").items


@pytest.mark.parametrize(
    "count", [3, MAX_TXN_OPS + 5], ids=["in the first pages' transaction", "over its operations"]
)
def test_exact_keys_are_read_in_the_snapshot_of_the_prefixes(store: MetaStore, count: int) -> None:
    """`list_prefixes(exact=...)`: single keys (a read's channel checkpoints) at the
    revision of the prefixes' listing, in the first pages' transaction while they fit in
    one, else at that revision after it; a key under another key's name is not read."""
    root = store.keys.root
    store.put(f"{root}/ex/list/1", b"listed")
    keys = [f"{root}/ex/key/{i}" for i in range(count)]
    for key in keys[:-1]:
        store.put(key, key.encode())
    store.put(f"{root}/ex/key/{count - 2}0", b"under another key's name")
    revision = store.put(f"{root}/ex/list/2", b"listed")

    out: list[list[list[KeyValue]]] = []
    sent = requests(store, lambda: out.append(store.list_prefixes([f"{root}/ex/list/"], exact=keys)))
    listed, *found = out[0]

    assert len(sent) == (1 if count <= MAX_TXN_OPS else 3), sent  # over it: the list, then two batches
    assert [kv.mod_revision for kv in listed][-1] == revision
    assert [[kv.value for kv in items] for items in found] == [[k.encode()] for k in keys[:-1]] + [[]]
    assert all(kv.mod_revision <= revision for items in found for kv in items)


def test_decoding_malformed_json_names_the_key() -> None:
    with pytest.raises(MalformedValueError) as bad:
        decode("vchan/meta/channel-cp/ch-1", b"{not json", MsgPosition)
    assert bad.value.key == "vchan/meta/channel-cp/ch-1"
    assert "vchan/meta/channel-cp/ch-1" in str(bad.value) and "not JSON" in str(bad.value)


def test_decoding_a_value_of_another_schema_version_names_the_key() -> None:
    with pytest.raises(MalformedValueError, match="schema version 2"):
        decode("k", b'{"v": 2, "channel": "c", "offset": 1, "timestamp": 1}', MsgPosition)


def test_get_model_of_a_malformed_value_names_the_key(store: MetaStore) -> None:
    key = store.keys.channel_checkpoint("ch-bad")
    store.put(key, b'{"v": 1, "channel": "ch-bad", "offset": "ten"')

    with pytest.raises(MalformedValueError) as bad:
        store.get_model(key, MsgPosition)

    assert bad.value.key == key


def test_get_model_of_a_value_missing_a_field_names_the_key_and_field(store: MetaStore) -> None:
    key = store.keys.channel_checkpoint("ch-field")
    store.put(key, {"channel": "ch-field", "timestamp": 5})

    with pytest.raises(MalformedValueError) as bad:
        store.get_model(key, MsgPosition)

    assert bad.value.key == key and "offset" in str(bad.value)


def test_list_models_skips_and_counts_malformed_values_when_asked(store: MetaStore) -> None:
    prefix = store.keys.channel_checkpoint.prefix
    good = MsgPosition("ch-a", 1, 2)
    store.put(store.keys.channel_checkpoint("ch-a"), good)
    store.put(store.keys.channel_checkpoint("ch-b"), b"garbage")
    written = store.put(store.keys.channel_checkpoint("ch-c"), b"[1, 2]")

    with pytest.raises(MalformedValueError) as bad:
        store.list_models(prefix, MsgPosition)
    assert bad.value.key == store.keys.channel_checkpoint("ch-b")

    decoded, revision = store.list_models(prefix, MsgPosition, skip_malformed=True)
    assert [d.model for d in decoded] == [good]
    assert store.malformed_skipped == 2
    assert written <= revision <= store.revision()  # other tests write to the shared etcd too


def test_encoded_values_carry_the_schema_version() -> None:
    assert encode(MsgPosition("c", 1, 2)).startswith(b'{"v":1,')


# --- etcd unreachable ---------------------------------------------------------------------


def _settings_for(settings: Settings, endpoint: str, timeout: float) -> Settings:
    return replace(settings, etcd_endpoints=(endpoint,), etcd_timeout=timeout)


def test_etcd_on_a_closed_port_gives_meta_unavailable_naming_the_endpoint(settings: Settings) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    store = MetaStore.connect(_settings_for(settings, endpoint, timeout=1.0))
    started = time.monotonic()

    with pytest.raises(MetaUnavailableError) as down:
        store.get(store.keys.tso())

    assert time.monotonic() - started < 1.0 + 2
    assert endpoint in str(down.value) and down.value.endpoints == (endpoint,)
    store.close()


def test_etcd_that_accepts_but_never_answers_times_out_within_the_configured_timeout(
    settings: Settings,
) -> None:
    # A listening socket nobody accepts from: TCP connects, gRPC never gets an answer.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        store = MetaStore.connect(_settings_for(settings, endpoint, timeout=1.0))
        started = time.monotonic()

        with pytest.raises(MetaUnavailableError) as down:
            store.put(store.keys.id_allocator(), b"1")

        assert time.monotonic() - started < 1.0 + 2
        assert endpoint in str(down.value)
        store.close()


def test_killed_etcd_gives_meta_unavailable_within_bounded_time(
    private_etcd: EmbeddedEtcd, private_settings: Settings
) -> None:
    store = MetaStore.connect(replace(private_settings, etcd_timeout=1.0))
    store.put(store.keys.tso(), b"1")
    private_etcd.kill()
    started = time.monotonic()

    with pytest.raises(MetaUnavailableError) as down:
        store.get(store.keys.tso())

    assert time.monotonic() - started < 1.0 + 2
    assert private_etcd.endpoint in str(down.value)
    store.close()


def test_frozen_etcd_gives_meta_unavailable_within_bounded_time(
    private_etcd: EmbeddedEtcd, private_settings: Settings
) -> None:
    store = MetaStore.connect(replace(private_settings, etcd_timeout=1.0))
    store.put(store.keys.tso(), b"1")
    assert private_etcd.pid is not None
    os.kill(private_etcd.pid, signal.SIGSTOP)
    try:
        # SIGSTOP is delivered asynchronously: a request sent at once may still be served.
        stat = Path(f"/proc/{private_etcd.pid}/stat")

        def state() -> str:
            return stat.read_text().rsplit(")", 1)[1].split()[0]

        wait_until(
            lambda: state() == "T", 5, "etcd stopped by SIGSTOP (state T)", interval=0.01, describe=state
        )
        started = time.monotonic()
        with pytest.raises(MetaUnavailableError) as down:
            store.get(store.keys.tso())
        assert time.monotonic() - started < 1.0 + 2
        assert private_etcd.endpoint in str(down.value)
    finally:
        os.kill(private_etcd.pid, signal.SIGCONT)
        store.close()


def test_revoking_an_unknown_lease_is_refused_not_reported_as_unavailable(store: MetaStore) -> None:
    lease = store.grant(5)
    store.revoke(lease)
    with pytest.raises(MetaError, match="etcd refused revoke lease") as err:
        store.revoke(lease)
    assert not isinstance(err.value, MetaUnavailableError)


# --- paged reads and write bounds --------------------------------------------------------


def _write_keys(store: MetaStore, prefix: str, count: int) -> None:
    store.txn({}, {f"{prefix}{i:04d}": {"v": 1, "i": i} for i in range(count)})


def test_a_listing_whose_revision_is_compacted_mid_walk_starts_again_at_a_fresh_revision(
    private_store: MetaStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = private_store
    monkeypatch.setattr(store_module, "PAGE_KEYS", 10)
    prefix = store.keys.root + "/walk/"
    _write_keys(store, prefix, 35)
    get_range = store.client.get_range_response
    pages: list[object] = []

    def page_then_compact(*args: object, **kwargs: object) -> object:
        page = get_range(*args, **kwargs)
        pages.append(kwargs["revision"])
        if len(pages) == 1:  # between the first and second page: a write, and a compaction past it
            store.put(f"{prefix}9999", {"v": 1, "i": 9999})
            store.compact(store.revision())
        return page

    monkeypatch.setattr(store.client, "get_range_response", page_then_compact)
    with caplog.at_level(logging.WARNING, logger=store_module.__name__):
        listed = store.list_prefix(prefix)
    assert len(listed.items) == 36 and listed.items[-1].key == f"{prefix}9999"
    assert listed.revision == store.revision()
    assert "was compacted" in caplog.text and "listing again at a fresh revision" in caplog.text
    assert pages[0] is None and pages[1] is None  # the second page failed: the walk began again


def test_a_listing_at_a_compacted_revision_raises_naming_the_prefix_and_revision(
    private_store: MetaStore,
) -> None:
    store = private_store
    prefix = store.keys.root + "/walk/"
    _write_keys(store, prefix, 3)
    old = store.revision()
    store.put(f"{prefix}0000", {"v": 1, "i": -1})
    store.compact(store.revision())
    with pytest.raises(RevisionCompactedError) as gone:
        store.list_prefix(prefix, revision=old)
    assert gone.value.prefix == prefix and gone.value.revision == old


def test_several_prefixes_are_listed_in_one_round_trip_and_a_long_one_paged_on_at_its_revision(
    store: MetaStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first page of every prefix comes in one transaction (PAGE_KEYS keys between
    them); a prefix with more is read on in pages at that transaction's revision, so a write
    landing meanwhile is in no list."""
    monkeypatch.setattr(store_module, "PAGE_KEYS", 40)  # 10 keys a prefix in the first pages
    root = store.keys.root + "/first"
    prefixes = [f"{root}/a/", f"{root}/b/", f"{root}/c/", f"{root}/d/"]
    for prefix, count in zip(prefixes, (3, 25, 0, 4), strict=True):
        _write_keys(store, prefix, count)
    revision = store.revision()
    get_range = store.client.get_range_response

    def page_after_a_write(*args: object, **kwargs: object) -> object:
        store.put(f"{root}/a/9999", {"v": 1, "i": 9999})
        store.put(f"{root}/b/9999", {"v": 1, "i": 9999})
        return get_range(*args, **kwargs)

    monkeypatch.setattr(store.client, "get_range_response", page_after_a_write)
    answers = []
    calls = requests(store, lambda: answers.append(store.list_prefixes_at(prefixes)))
    [(listed, at)] = answers

    assert at == revision
    assert [len(items) for items in listed] == [3, 25, 0, 4]
    assert [kv.key for kv in listed[1]] == [f"{root}/b/{i:04d}" for i in range(25)]
    lists = [c for c in calls if c.startswith("list")]
    assert len(lists) == 2, lists  # the four first pages, then the rest of b/ in one page
    monkeypatch.setattr(store.client, "get_range_response", get_range)
    assert listed == [store.list_prefix(p, revision=revision).items for p in prefixes]


def test_get_many_reads_keys_in_one_round_trip_and_more_than_a_transaction_holds_at_one_revision(
    store: MetaStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = store.keys.root + "/many-keys"
    keys = [f"{root}/{i}" for i in range(MAX_TXN_OPS + 2)]
    store.txn({}, {k: b"old" for k in keys[:100]})
    store.txn({}, {k: b"old" for k in keys[100:]})
    got = []
    calls = requests(store, lambda: got.append(store.get_many([keys[0], f"{root}/absent", keys[1]])))
    [few] = got
    assert [kv.value if kv else None for kv in few] == [b"old", None, b"old"]
    assert len(calls) == 1, calls

    range_txn = store._range_txn

    def write_after_the_first_batch(batch: list[str], revision: int) -> object:
        answer = range_txn(batch, revision)
        store.put(keys[-1], b"new")  # lands between the two transactions
        return answer

    monkeypatch.setattr(store, "_range_txn", write_after_the_first_batch)
    found = store.get_many(keys)
    assert len(found) == len(keys) and all(kv is not None and kv.value == b"old" for kv in found)

    store.put(f"{root}/bad", b"{not json")
    with pytest.raises(MalformedValueError) as bad:
        store.get_models([f"{root}/absent", f"{root}/bad"], MsgPosition)
    assert bad.value.key == f"{root}/bad"


def test_first_pages_of_values_near_the_bound_over_the_receive_limit_are_read_with_fewer_keys(
    store: MetaStore, caplog: pytest.LogCaptureFixture
) -> None:
    root = store.keys.root + "/wide-first"
    prefixes = [f"{root}/{name}/" for name in "xyz"]
    for at, prefix in enumerate(prefixes):  # 6 MiB in all, 2 MiB a prefix
        for i in range(2):
            store.put(f"{prefix}{i}", bytes([at * 2 + i]) * MAX_VALUE_BYTES)
    with caplog.at_level(logging.WARNING, logger=store_module.__name__):
        listed = store.list_prefixes(prefixes)
    assert [[kv.value[0] for kv in items] for items in listed] == [[0, 1], [2, 3], [4, 5]]
    assert "first pages of 3 prefixes over the receive limit" in caplog.text


def test_a_value_over_the_bound_is_refused_at_write_naming_key_and_size(store: MetaStore) -> None:
    key = store.keys.root + "/big"
    value = b"x" * (MAX_VALUE_BYTES + 1)
    for write in (
        lambda: store.put(key, value),
        lambda: store.cas(key, 0, value),
        lambda: store.txn({}, {key: value}),
    ):
        with pytest.raises(ValueTooLargeError) as refused:
            write()
        assert refused.value.key == key and refused.value.size == MAX_VALUE_BYTES + 1
        assert key in str(refused.value) and str(MAX_VALUE_BYTES + 1) in str(refused.value)
    assert store.get(key) is None


def test_a_transaction_over_etcds_operation_bound_is_refused_naming_it(store: MetaStore) -> None:
    puts = {f"{store.keys.root}/many/{i}": b"1" for i in range(MAX_TXN_OPS + 1)}
    with pytest.raises(TransactionTooLargeError) as refused:
        store.txn({}, puts)
    assert refused.value.operations == MAX_TXN_OPS + 1
    assert f"{store.keys.root}/many/0" in refused.value.operation
    assert store.list_prefix(f"{store.keys.root}/many/").items == []


def test_a_transaction_over_etcds_request_bound_is_refused_naming_it(store: MetaStore) -> None:
    half = b"x" * (MAX_REQUEST_BYTES // 2)
    puts = {f"{store.keys.root}/wide/{i}": half for i in range(3)}
    with pytest.raises(TransactionTooLargeError) as refused:
        store.txn({}, puts)
    assert refused.value.size > MAX_REQUEST_BYTES and refused.value.operations == 3
    assert store.list_prefix(f"{store.keys.root}/wide/").items == []


def test_a_page_of_values_near_the_bound_over_the_receive_limit_is_read_with_fewer_keys(
    store: MetaStore, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = store.keys.root + "/large/"
    for i in range(5):  # 5 MiB in all: more than one gRPC response may carry
        store.put(f"{prefix}{i}", bytes([i]) * MAX_VALUE_BYTES)
    with caplog.at_level(logging.WARNING, logger=store_module.__name__):
        listed = store.list_prefix(prefix)
    assert [kv.value[0] for kv in listed.items] == list(range(5))
    assert "over the receive limit" in caplog.text
