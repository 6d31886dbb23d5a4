"""Watching a prefix by revision: the sensor pull API and the long-running PrefixWatcher."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.errors import MetaUnavailableError
from vchan_assets.meta.store import MetaStore, Snapshot
from vchan_assets.meta.watch import EventKind, PrefixWatcher, WatchEvent, poll_changes
from vchan_assets.model import MsgPosition

NODE = 7


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """This module's own etcd server. Its tests compare a cursor with etcd's revision: a
    write of another test on the shared server (a lease of a stopped process expiring, say)
    moves that revision past anything a watch of one prefix can prove."""
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd-watch")).start()
    yield server
    server.stop()


def _prefix(store: MetaStore) -> str:
    return store.keys.channel_watch.under(NODE)


def _key(store: MetaStore, channel: str) -> str:
    return store.keys.channel_watch(NODE, channel)


def _content(store: MetaStore, prefix: str) -> dict[str, bytes]:
    return {kv.key: kv.value for kv in store.list_prefix(prefix).items}


class View:
    """What a node believes is under its prefix, maintained only from watcher callbacks."""

    def __init__(self) -> None:
        self.items: dict[str, bytes] = {}
        self.events: list[WatchEvent] = []
        self.relists: list[Snapshot] = []
        self.lock = threading.Lock()

    def on_relist(self, snapshot: Snapshot) -> None:
        with self.lock:
            self.relists.append(snapshot)
            self.items = {kv.key: kv.value for kv in snapshot.items}

    def on_event(self, event: WatchEvent) -> None:
        with self.lock:
            self.events.append(event)
            if event.kind is EventKind.PUT:
                self.items[event.key] = event.value
            else:
                self.items.pop(event.key, None)


# --- poll_changes ---------------------------------------------------------------------------


def test_poll_without_a_cursor_relists_the_whole_prefix(store: MetaStore) -> None:
    store.put(_key(store, "a"), b"1")
    store.put(_key(store, "b"), b"2")

    changes = poll_changes(store, _prefix(store), None)

    assert changes.relisted and changes.reason == "no cursor" and not changes.events
    assert changes.snapshot is not None
    assert [kv.key for kv in changes.snapshot.items] == [_key(store, "a"), _key(store, "b")]
    assert changes.revision == changes.snapshot.revision


def test_poll_returns_every_change_after_the_cursor_in_order(store: MetaStore) -> None:
    store.put(_key(store, "a"), b"1")
    cursor = store.revision()
    store.put(_key(store, "b"), b"2")
    store.put(_key(store, "a"), b"1bis")
    store.delete(_key(store, "b"))
    store.put(store.keys.channel_watch(NODE + 1, "other-node"), b"x")  # outside the prefix

    changes = poll_changes(store, _prefix(store), cursor)

    assert not changes.relisted
    assert [(e.kind, e.key.rsplit("/", 1)[1], e.value) for e in changes.events] == [
        (EventKind.PUT, "b", b"2"),
        (EventKind.PUT, "a", b"1bis"),
        (EventKind.DELETE, "b", b""),
    ]
    revisions = [e.mod_revision for e in changes.events]
    assert revisions == sorted(revisions) and revisions[0] > cursor
    assert changes.events[1].version == 2
    assert changes.revision == store.revision()  # caught up with the store


def test_poll_from_the_returned_cursor_repeats_nothing(store: MetaStore) -> None:
    cursor = store.revision()
    store.put(_key(store, "a"), b"1")
    first = poll_changes(store, _prefix(store), cursor)

    second = poll_changes(store, _prefix(store), first.revision)
    store.put(_key(store, "b"), b"2")
    third = poll_changes(store, _prefix(store), second.revision)

    assert len(first.events) == 1 and not second.events
    assert [e.key for e in third.events] == [_key(store, "b")]


def test_poll_sees_a_delete_when_nothing_else_changed(store: MetaStore) -> None:
    store.put(_key(store, "a"), b"1")
    cursor = store.revision()
    store.delete(_key(store, "a"))

    changes = poll_changes(store, _prefix(store), cursor, settle=0.0)

    assert [(e.kind, e.key) for e in changes.events] == [(EventKind.DELETE, _key(store, "a"))]


def test_poll_sees_a_key_created_and_deleted_between_two_polls(store: MetaStore) -> None:
    cursor = store.revision()
    store.put(_key(store, "brief"), b"ToWatch")
    store.delete(_key(store, "brief"))

    # No net change is visible in a listing: only the watch can tell. (A generous settle
    # costs nothing here: the answer returns as soon as the events arrive.)
    changes = poll_changes(store, _prefix(store), cursor, settle=3.0)

    assert [e.kind for e in changes.events] == [EventKind.PUT, EventKind.DELETE]


def test_poll_advances_the_cursor_past_changes_elsewhere(store: MetaStore) -> None:
    cursor = store.revision()
    store.put(store.keys.channel_checkpoint("ch"), MsgPosition("ch", 1, 1))

    changes = poll_changes(store, _prefix(store), cursor)

    assert not changes.events and not changes.relisted
    assert changes.revision == store.revision() > cursor


def test_poll_with_a_compacted_cursor_relists_every_key(private_store: MetaStore) -> None:
    store = private_store
    store.put(_key(store, "a"), b"1")
    cursor = store.revision()
    for i in range(5):
        store.put(_key(store, f"ch-{i}"), str(i).encode())
    store.delete(_key(store, "a"))
    store.compact(store.revision())
    store.put(_key(store, "after-compaction"), b"z")

    changes = poll_changes(store, _prefix(store), cursor)

    assert changes.relisted and changes.reason == "cursor compacted" and changes.snapshot is not None
    assert {kv.key: kv.value for kv in changes.snapshot.items} == _content(store, _prefix(store))
    assert len(changes.snapshot.items) == 6
    assert changes.revision == store.revision()


def test_poll_with_a_cursor_ahead_of_etcd_relists(store: MetaStore) -> None:
    changes = poll_changes(store, _prefix(store), store.revision() + 1000)

    assert changes.relisted and changes.reason == "cursor ahead of etcd"


def test_poll_against_a_dead_etcd_fails_clearly_in_bounded_time(
    private_etcd: EmbeddedEtcd, private_store: MetaStore
) -> None:
    cursor = private_store.revision()
    private_etcd.kill()
    started = time.monotonic()

    with pytest.raises(MetaUnavailableError) as down:
        poll_changes(private_store, _prefix(private_store), cursor)

    assert time.monotonic() - started < private_store.client.timeout + 2
    assert private_etcd.endpoint in str(down.value)


# --- PrefixWatcher ------------------------------------------------------------------------


def test_watcher_lists_the_prefix_at_start_then_delivers_changes_in_order(store: MetaStore) -> None:
    store.put(_key(store, "before"), b"0")
    view = View()
    with PrefixWatcher(store, _prefix(store), view.on_event, view.on_relist) as watcher:
        assert watcher.wait_for(store.revision(), timeout=5)
        store.put(_key(store, "a"), b"1")
        store.put(_key(store, "a"), b"2")
        store.delete(_key(store, "before"))
        assert watcher.wait_for(store.revision(), timeout=5)

    assert len(view.relists) == 1 and [kv.key for kv in view.relists[0].items] == [_key(store, "before")]
    assert [(e.kind, e.value) for e in view.events] == [
        (EventKind.PUT, b"1"),
        (EventKind.PUT, b"2"),
        (EventKind.DELETE, b""),
    ]
    assert view.items == _content(store, _prefix(store))


def test_watcher_resumed_after_compaction_relists_and_ends_with_etcds_content(
    private_store: MetaStore,
) -> None:
    store, prefix = private_store, _prefix(private_store)
    view = View()
    for i in range(3):
        store.put(_key(store, f"ch-{i}"), b"ToWatch")
    first = PrefixWatcher(store, prefix, view.on_event, view.on_relist).start()
    store.put(_key(store, "ch-0"), b"WatchSuccess")
    assert first.wait_for(store.revision(), timeout=5)
    first.stop()
    cursor = first.revision

    # While no watcher runs: changes, a compaction that loses them, more changes.
    store.put(_key(store, "ch-1"), b"ToRelease")
    store.delete(_key(store, "ch-2"))
    store.put(_key(store, "ch-3"), b"ToWatch")
    store.compact(store.revision())
    store.delete(_key(store, "ch-0"))
    store.put(_key(store, "ch-4"), b"ToWatch")

    second = PrefixWatcher(store, prefix, view.on_event, view.on_relist, start_revision=cursor).start()
    try:
        assert second.wait_for(store.revision(), timeout=10)
        store.put(_key(store, "ch-5"), b"ToWatch")
        assert second.wait_for(store.revision(), timeout=5)
    finally:
        second.stop()

    assert second.relists == 1 and len(view.relists) == 2
    assert view.items == _content(store, prefix)
    assert _key(store, "ch-5") in view.items


def test_watcher_resumed_from_a_live_cursor_replays_without_relisting(store: MetaStore) -> None:
    prefix = _prefix(store)
    view = View()
    first = PrefixWatcher(store, prefix, view.on_event, view.on_relist).start()
    assert first.wait_for(store.revision(), timeout=5)
    first.stop()
    store.put(_key(store, "while-stopped"), b"1")

    second = PrefixWatcher(store, prefix, view.on_event, view.on_relist, start_revision=first.revision)
    with second:
        assert second.wait_for(store.revision(), timeout=5)

    assert second.relists == 0
    assert [e.key for e in view.events] == [_key(store, "while-stopped")]


def test_watcher_across_an_etcd_restart_misses_nothing_and_repeats_nothing(
    private_etcd: EmbeddedEtcd, private_store: MetaStore
) -> None:
    store, prefix = private_store, _prefix(private_store)
    view = View()
    watcher = PrefixWatcher(store, prefix, view.on_event, view.on_relist).start()
    try:
        assert watcher.wait_for(store.revision(), timeout=5)  # listed: what follows are events
        store.put(_key(store, "a"), b"1")
        assert watcher.wait_for(store.revision(), timeout=5)

        private_etcd.restart()
        for i in range(5):
            for _ in range(50):  # the client needs a moment to reconnect
                try:
                    store.put(_key(store, f"after-{i}"), str(i).encode())
                    break
                except MetaUnavailableError:
                    time.sleep(0.1)
        store.delete(_key(store, "a"))
        assert watcher.wait_for(store.revision(), timeout=10)
    finally:
        watcher.stop()

    delivered = [(e.kind, e.key, e.mod_revision) for e in view.events]
    assert len(delivered) == len(set(delivered)) == 7
    assert [e.mod_revision for e in view.events] == sorted(e.mod_revision for e in view.events)
    assert view.items == _content(store, prefix)
    assert len(view.relists) == 1  # resumed from its cursor, no relist needed
    assert watcher.reconnects >= 1


def test_watcher_keeps_going_after_a_callback_raises(
    store: MetaStore, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    def on_event(event: WatchEvent) -> None:
        seen.append(event.key)
        if event.key.endswith("poison"):
            raise ValueError("cannot handle this watch info")

    with PrefixWatcher(store, _prefix(store), on_event, lambda snapshot: None) as watcher:
        assert watcher.wait_for(store.revision(), timeout=5)
        store.put(_key(store, "poison"), b"{bad")
        store.put(_key(store, "fine"), b"ok")
        assert watcher.wait_for(store.revision(), timeout=5)

    assert seen == [_key(store, "poison"), _key(store, "fine")]
    assert watcher.callback_errors == 1
    assert _key(store, "poison") in caplog.text


def test_stopped_watcher_delivers_nothing_more(store: MetaStore) -> None:
    view = View()
    watcher = PrefixWatcher(store, _prefix(store), view.on_event, view.on_relist).start()
    assert watcher.wait_for(store.revision(), timeout=5)

    watcher.stop()
    store.put(_key(store, "late"), b"1")
    time.sleep(0.3)

    assert not watcher.running and not view.events
