"""Active-standby election of the DataCoord on `session/datacoord`."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.session import Election
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import NodeSession
from vchan_assets.testing.waiting import wait_until

from .helpers import ChildNode

TTL = 2.0
SLACK = 2.0


def _coord(node_id: int) -> NodeSession:
    return NodeSession(
        node_id=node_id, address=f"127.0.0.1:{13000 + node_id}", version="test", started_at=1.0
    )


@pytest.fixture
def contenders(settings: Settings) -> Iterator[Callable[..., Election]]:
    """Elections on their own MetaStore clients (as separate coordinator processes would)."""
    made: list[tuple[Election, MetaStore]] = []

    def make(node_id: int, on_lost: Callable[[], None] | None = None) -> Election:
        store = MetaStore.connect(settings)
        election = Election(store, _coord(node_id), TTL, on_lost=on_lost, poll_interval=0.1)
        made.append((election, store))
        return election

    yield make
    for election, store in made:
        election.resign()
        store.close()


class Campaign(threading.Thread):
    """A standby campaigning in the background; `won_at` is when it became leader."""

    def __init__(self, election: Election, timeout: float) -> None:
        super().__init__(daemon=True)
        self.election = election
        self.timeout = timeout
        self.won: bool | None = None
        self.won_at = 0.0

    def run(self) -> None:
        self.won = self.election.campaign(timeout=self.timeout)
        self.won_at = time.monotonic()


def test_of_two_contenders_exactly_one_leads(contenders: Callable[..., Election]) -> None:
    first, second = contenders(1), contenders(2)

    assert first.campaign(timeout=2)
    assert not second.campaign(timeout=0.5)

    assert first.is_leader and not second.is_leader
    leader = second.leader()
    assert leader is not None and b'"node_id":1' in leader.value


def test_contenders_racing_for_an_empty_seat_elect_one(contenders: Callable[..., Election]) -> None:
    elections = [contenders(i) for i in range(1, 5)]
    barrier = threading.Barrier(len(elections))
    results: list[bool] = []

    def race(election: Election) -> None:
        barrier.wait()
        results.append(election.try_acquire())

    threads = [threading.Thread(target=race, args=(e,)) for e in elections]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(results) == [False, False, False, True]
    assert sum(e.is_leader for e in elections) == 1


def test_standby_takes_over_when_the_leader_resigns(contenders: Callable[..., Election]) -> None:
    leader, standby = contenders(1), contenders(2)
    assert leader.campaign(timeout=2)
    campaign = Campaign(standby, timeout=10)
    campaign.start()
    time.sleep(0.3)
    assert campaign.won is None  # still waiting

    resigned_at = time.monotonic()
    leader.resign()
    campaign.join(5)

    assert campaign.won is True and standby.is_leader and not leader.is_leader
    assert campaign.won_at - resigned_at < 1.0


def test_leader_whose_session_expires_is_told_and_the_standby_takes_over(
    contenders: Callable[..., Election],
) -> None:
    lost = threading.Event()
    leader, standby = contenders(1, on_lost=lost.set), contenders(2)
    assert leader.campaign(timeout=2)
    campaign = Campaign(standby, timeout=TTL + 10)
    campaign.start()
    assert leader.session is not None

    leader.session.suspend_keepalive()  # a hung leader

    assert lost.wait(TTL + SLACK)
    assert not leader.is_leader
    campaign.join(TTL + SLACK)
    assert campaign.won is True and standby.is_leader


def test_standby_takes_over_when_the_leader_process_is_killed(
    contenders: Callable[..., Election], spawn_node: Callable[..., ChildNode]
) -> None:
    child = spawn_node("elect", 1, TTL)
    assert child.read_line(timeout=20).startswith("leader")
    standby = contenders(2)
    assert not standby.campaign(timeout=0.3)

    child.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert standby.campaign(timeout=TTL + 5)

    assert time.monotonic() - killed_at < TTL + SLACK
    leader = standby.leader()
    assert leader is not None and b'"node_id":2' in leader.value


def test_a_resign_that_finds_another_resign_under_way_returns_once_the_seat_is_free(
    store: MetaStore, contenders: Callable[..., Election]
) -> None:
    """A stopping DataCoord resigns twice, from its stop thread and from its loop's exit, and
    exits once the loop's resign returns: that resign must not return while the other is still
    revoking the lease, or the process exits first and the standby waits out the TTL (a CI run
    saw the standby wait past 10 s)."""
    for _ in range(20):
        leader = contenders(1)
        assert leader.try_acquire()
        first = threading.Thread(target=leader.resign)
        first.start()
        # Polled without sleeping: the first resign's revoke takes milliseconds.
        wait_until(
            lambda leader=leader: leader.session is None, 5, "the first resign took the session", interval=0
        )
        leader.resign()
        assert store.get(leader.key) is None, "resign returned with the leader's key still in etcd"
        first.join()
