"""One clock: the timestamps of any number of processes stay on the wall clock of the
machine that issues them (within 0.5 s), strictly increasing and never issued twice; a
mark persisted ahead of the clock is followed, not extended, until the clock passes it;
an etcd outage stops issuing and makes nothing jump."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.allocator import TimestampOracle, now_ts, read_clock_mark
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.errors import MalformedValueError, MetaUnavailableError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import compose_ts, physical_ms

from .helpers import through_reconnect

# The behaviour itself: a timestamp is within this of the wall clock when it is issued.
BOUND_MS = 500

# One short-lived process: an oracle of its own on the test's etcd key root, a few
# timestamps, each printed with the wall clock read just before and just after it.
ONE_PROCESS = """
import json, sys, time
from dataclasses import replace
from vchan_assets.config import Settings
from vchan_assets.meta.allocator import TimestampOracle
from vchan_assets.meta.store import MetaStore
settings = replace(Settings(), etcd_endpoints=(sys.argv[1],), root=sys.argv[2])
store = MetaStore.connect(settings)
oracle = TimestampOracle(store)
for _ in range(3):
    before = time.time()
    ts = oracle.now()
    print(json.dumps([before, ts, time.time()]), flush=True)
store.close()
"""


def _on_the_clock(before: float, ts: int, after: float) -> bool:
    """`ts`, issued between the wall-clock times `before` and `after`, is within the bound
    of the clock at some moment in between."""
    return int(before * 1000) - BOUND_MS <= physical_ms(ts) <= int(after * 1000) + BOUND_MS


def _issued(oracle: TimestampOracle, count: int = 1) -> tuple[float, int, float]:
    before = time.time()
    ts = oracle.alloc(count)
    return before, ts, time.time()


def test_oracles_started_one_after_another_stay_on_the_wall_clock(settings: Settings) -> None:
    stamps = []
    for _ in range(200):  # each a new oracle on a new connection, as a new process has
        store = MetaStore.connect(settings)
        oracle = TimestampOracle(store)
        stamps += [_issued(oracle), _issued(oracle, 2)]
        store.close()

    assert all(_on_the_clock(*s) for s in stamps), f"newest {stamps[-1]}: ahead of the wall clock"
    ts = [t for _, t, _ in stamps]
    assert all(b > a for a, b in zip(ts, ts[1:], strict=False))


def test_oracles_taking_turns_each_issue_above_what_the_other_issued_meanwhile(
    settings: Settings, store: MetaStore
) -> None:
    stores = [MetaStore.connect(settings) for _ in range(2)]
    oracles = [TimestampOracle(s) for s in stores]

    counts = [1 + i % 3 for i in range(400)]
    lasts = [oracles[i % 2].alloc(n) for i, n in enumerate(counts)]  # many in one millisecond
    for s in stores:
        s.close()

    firsts = [last - n + 1 for last, n in zip(lasts, counts, strict=True)]
    assert all(first > last for first, last in zip(firsts[1:], lasts, strict=False)), "blocks overlap"
    assert read_clock_mark(store).last_ts == lasts[-1]


def test_a_reads_now_is_above_every_timestamp_issued_before_it_and_below_every_later_one(
    settings: Settings, store: MetaStore
) -> None:
    producer_store = MetaStore.connect(settings)
    producer = TimestampOracle(producer_store)

    issued = []
    for _ in range(50):
        issued += [producer.now(), now_ts(store)]  # "now" keeps the mark its store saw last
    producer_store.close()

    assert all(b > a for a, b in zip(issued, issued[1:], strict=False))


def test_processes_started_one_after_another_and_side_by_side_stay_on_the_wall_clock(
    settings: Settings,
) -> None:
    assert settings.etcd_endpoints is not None
    command = [sys.executable, "-c", ONE_PROCESS, settings.etcd_endpoints[0], settings.root]

    def run(n: int) -> list[list[tuple[float, int, float]]]:
        children = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        outs = [child.communicate(timeout=60)[0] for child in children]
        assert all(child.returncode == 0 for child in children)
        return [[tuple(json.loads(line)) for line in out.splitlines()] for out in outs]

    in_a_row = [stamp for _ in range(8) for stamps in run(1) for stamp in stamps]
    side_by_side = [stamp for _ in range(2) for stamps in run(4) for stamp in stamps]

    everything = in_a_row + side_by_side
    assert all(_on_the_clock(*s) for s in everything)
    ts = [t for _, t, _ in in_a_row]
    assert all(b > a for a, b in zip(ts, ts[1:], strict=False)), "each process starts above the last"
    assert len({t for _, t, _ in everything}) == len(everything), "a timestamp issued twice"


def test_timestamps_follow_a_mark_persisted_far_ahead_without_extending_it(
    store: MetaStore, caplog: pytest.LogCaptureFixture
) -> None:
    ahead_ms = int(time.time() * 1000) + 200_000
    store.put(store.keys.tso(), str(ahead_ms).encode())  # an earlier version's window end

    with caplog.at_level(logging.WARNING, logger="vchan_assets.meta.allocator"):
        stamps = [TimestampOracle(store).now() for _ in range(50)]  # 50 process starts

    assert stamps == list(range(compose_ts(ahead_ms), compose_ts(ahead_ms) + 50)), "logical steps"
    assert read_clock_mark(store).last_ts == stamps[-1], "the mark is not extended"
    assert any(
        "200.0 s ahead of this machine's wall clock" in r.getMessage()
        and "back on the wall clock" in r.getMessage()
        for r in caplog.records
    )


def test_an_oracle_that_knew_the_mark_follows_an_earlier_versions_mark_written_since(
    store: MetaStore,
) -> None:
    oracle = TimestampOracle(store)
    oracle.now()
    ahead_ms = int(time.time() * 1000) + 200_000
    store.put(store.keys.tso(), str(ahead_ms).encode())  # an older process's window, meanwhile

    assert oracle.now() == compose_ts(ahead_ms)


def test_timestamps_come_back_to_the_wall_clock_once_it_passes_a_mark_ahead(store: MetaStore) -> None:
    ahead_ms = int(time.time() * 1000) + 200_000
    store.put(store.keys.tso(), str(ahead_ms).encode())
    # The same machine 201 s later (its clock read through the oracle's `clock`).
    later: Callable[[], float] = lambda: time.time() + 201  # noqa: E731
    oracle = TimestampOracle(store, clock=later)
    first = TimestampOracle(store).now()  # still on the mark

    before, ts, after = later(), oracle.now(), later()

    assert ts > first
    assert _on_the_clock(before, ts, after)


def test_a_mark_slightly_ahead_converges_on_the_real_clock(store: MetaStore) -> None:
    ahead_ms = int(time.time() * 1000) + 700
    store.put(store.keys.tso(), str(ahead_ms).encode())
    oracle = TimestampOracle(store)
    stamps = []
    while time.time() * 1000 < ahead_ms + 100:
        stamps.append(_issued(oracle))
        time.sleep(0.01)

    assert physical_ms(stamps[0][1]) == ahead_ms
    assert all(physical_ms(ts) <= max(ahead_ms, int(after * 1000)) for _, ts, after in stamps)
    assert _on_the_clock(*stamps[-1])


def test_an_etcd_outage_stops_issuing_and_nothing_jumps_after_it(
    private_etcd: EmbeddedEtcd, private_store: MetaStore, private_settings: Settings
) -> None:
    oracle = TimestampOracle(private_store)
    before = oracle.now()

    private_etcd.stop()
    with pytest.raises(MetaUnavailableError, match="unavailable during compare-and-swap"):
        oracle.now()
    private_etcd.restart()

    same = through_reconnect(lambda: _issued(oracle))
    new_store = MetaStore.connect(private_settings)
    new = _issued(TimestampOracle(new_store))
    new_store.close()
    assert before < same[1] < new[1]
    assert _on_the_clock(*same) and _on_the_clock(*new)


def test_a_mark_that_is_no_timestamp_stops_issuing_naming_the_key(store: MetaStore) -> None:
    store.put(store.keys.tso(), b'{"v":1,"last_ts":"soon"}')

    with pytest.raises(MalformedValueError) as bad:
        TimestampOracle(store).now()

    assert bad.value.key == store.keys.tso()
