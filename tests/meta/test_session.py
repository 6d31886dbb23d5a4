"""Node sessions on etcd leases: keep-alive, expiry, revoke, double registration, real pauses."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.codec import decode
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.session import Session, SessionConflictError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import NodeSession
from vchan_assets.testing.waiting import wait_until

from .helpers import ChildNode

TTL = 2.0  # etcd's minimum lease TTL with default election settings is 1.5 s
SLACK = 1.5


class Expiries:
    """Records `on_expired` calls."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.fired = threading.Event()

    def __call__(self) -> None:
        self.calls.append(time.monotonic())
        self.fired.set()


def _node(node_id: int) -> NodeSession:
    return NodeSession(
        node_id=node_id, address=f"127.0.0.1:{20000 + node_id}", version="test", started_at=1.0
    )


@pytest.fixture
def sessions() -> Iterator[list[Session]]:
    """Sessions opened by a test; closed at the end whatever happened."""
    opened: list[Session] = []
    yield opened
    for session in opened:
        session.close()


@pytest.fixture
def register(sessions: list[Session]) -> Callable[..., Session]:
    def make(store: MetaStore, node_id: int, ttl: float = TTL, on_expired: Expiries | None = None) -> Session:
        session = Session.for_datanode(store, _node(node_id), ttl, on_expired)
        sessions.append(session)
        return session.register()

    return make


def test_registered_session_is_its_node_value_on_its_lease(
    store: MetaStore, register: Callable[..., Session]
) -> None:
    session = register(store, 1)

    kv = store.get(store.keys.datanode_session(1))
    assert kv is not None and kv.lease == session.lease_id
    assert decode(kv.key, kv.value, NodeSession) == _node(1)
    assert session.alive


def test_session_kept_alive_outlives_its_ttl(store: MetaStore, register: Callable[..., Session]) -> None:
    expiries = Expiries()
    session = register(store, 2, on_expired=expiries)

    time.sleep(TTL + 1.0)

    assert session.alive and not expiries.calls
    assert store.get(store.keys.datanode_session(2)) is not None


def test_session_expiry_fires_once_when_keepalive_stops(
    store: MetaStore, register: Callable[..., Session]
) -> None:
    expiries = Expiries()
    session = register(store, 3, on_expired=expiries)
    suspended_at = time.monotonic()

    session.suspend_keepalive()

    assert expiries.fired.wait(TTL + SLACK)
    assert expiries.calls[0] - suspended_at <= TTL + SLACK
    assert not session.alive and session.expired
    assert session.expiry_reason is not None and "keep-alive" in session.expiry_reason
    wait_until(
        lambda: store.get(store.keys.datanode_session(3)) is None,
        TTL + SLACK,
        "the session gone",
        interval=0.05,
    )
    time.sleep(TTL / 2)
    assert len(expiries.calls) == 1


def test_session_expires_when_etcd_says_its_lease_is_gone(
    store: MetaStore, register: Callable[..., Session]
) -> None:
    expiries = Expiries()
    session = register(store, 4, ttl=3.0, on_expired=expiries)
    assert session.lease_id is not None

    store.revoke(session.lease_id)  # e.g. an operator, or etcd expired it during a pause

    assert expiries.fired.wait(3.0 / 3 + SLACK)
    assert session.expiry_reason is not None and "etcd reports" in session.expiry_reason


def test_session_expires_when_etcd_is_unreachable_longer_than_its_ttl(
    private_etcd: EmbeddedEtcd, private_store: MetaStore, register: Callable[..., Session]
) -> None:
    expiries = Expiries()
    session = register(private_store, 5, on_expired=expiries)

    private_etcd.kill()
    killed_at = time.monotonic()

    assert expiries.fired.wait(TTL + SLACK)
    assert expiries.calls[0] - killed_at <= TTL + SLACK
    assert session.expired and session.keepalive_failures >= 1


def test_session_survives_an_etcd_restart_shorter_than_its_ttl(
    private_etcd: EmbeddedEtcd, private_store: MetaStore, register: Callable[..., Session]
) -> None:
    expiries = Expiries()
    session = register(private_store, 6, ttl=6.0, on_expired=expiries)

    private_etcd.restart()
    time.sleep(6.0 / 3 + 0.5)  # at least one keep-alive after the restart

    assert session.alive and not expiries.calls
    kv = private_store.get(private_store.keys.datanode_session(6))
    assert kv is not None and kv.lease == session.lease_id


def test_close_revokes_the_lease_and_removes_the_key_at_once(
    store: MetaStore, register: Callable[..., Session]
) -> None:
    expiries = Expiries()
    session = register(store, 7, on_expired=expiries)

    session.close()

    assert store.get(store.keys.datanode_session(7)) is None
    assert not session.alive
    time.sleep(TTL / 2)
    assert not expiries.calls  # a clean close is not a loss of liveness


def test_registering_a_node_that_already_has_a_live_session_is_refused(
    store: MetaStore, settings: Settings, register: Callable[..., Session]
) -> None:
    first = register(store, 8)
    other = MetaStore.connect(settings)
    try:
        with pytest.raises(SessionConflictError) as refused:
            Session.for_datanode(other, _node(8), TTL).register()
    finally:
        other.close()

    assert refused.value.key == store.keys.datanode_session(8)
    assert refused.value.holder_lease == first.lease_id
    kv = store.get(store.keys.datanode_session(8))
    assert kv is not None and kv.lease == first.lease_id and first.alive


def test_node_registers_again_once_its_previous_session_is_gone(
    store: MetaStore, register: Callable[..., Session]
) -> None:
    register(store, 9).close()

    again = register(store, 9)

    kv = store.get(store.keys.datanode_session(9))
    assert kv is not None and kv.lease == again.lease_id


def test_sigstopped_node_loses_its_session_and_notices_when_continued(
    store: MetaStore, spawn_node: Callable[..., ChildNode], tmp_path: Path
) -> None:
    marker = tmp_path / "expired.txt"
    child = spawn_node("session", 10, TTL, marker)
    assert child.read_line(timeout=20).startswith("registered")
    key = store.keys.datanode_session(10)
    assert store.get(key) is not None

    child.signal(signal.SIGSTOP)
    gone_after = wait_until(lambda: store.get(key) is None, TTL + 3, "the session gone", interval=0.05)
    child.signal(signal.SIGCONT)

    assert gone_after <= TTL + 3
    assert child.read_line(timeout=60) == "expired"
    assert child.process.wait(timeout=60) == 0
    reason = marker.read_text()
    assert "keep-alive" in reason or "etcd reports" in reason
