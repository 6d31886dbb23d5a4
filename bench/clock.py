"""What one clock costs: the timestamp oracle that moves its mark in etcd on every
allocation (`TimestampOracle`) against the window oracle it replaced (a 3 s window of
physical time persisted ahead, timestamps issued inside it without a round trip), in one run
on one scratch etcd.

    .venv/bin/python -m bench.clock [--allocations 3000] [--inserts 300] [--rows 100] [--starts 50] [--repeat 3]

- allocations per second by one oracle, and by two oracles on two connections side by side
  (two processes' oracles on one key: the new one's compare-and-swaps then conflict);
- `Producer.insert` of `--rows` rows into a collection of 2 vchannels (one timestamp
  allocation per channel append), `--inserts` per design, the designs' inserts alternating
  one by one: the median seconds per call with each oracle, and the difference (what one
  clock adds to an insert call);
- how far ahead of the wall clock the newest timestamp is after `--starts` oracles started
  one after another (each a new process's oracle), each issuing one timestamp;
- a read's "now": before, the wall clock or the persisted window (one get); with one clock a
  timestamp from the oracle (`now_ts`: one compare-and-swap), `--inserts` of each, alternating.
"one clock, version swap" is the same clock with a compare-and-swap on the version of the
mark last seen (any allocation by another oracle since then costs a second round trip),
against the shipped compare of the stored mark with the new timestamp. The designs
alternate within each of `--repeat` rounds (so a change of load hits them all), each
on its own key and collection; medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

from bench import bench_system
from vchan_assets.meta.allocator import TimestampOracle, now_ts
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import LOGICAL_BITS, CollectionSchema, compose_ts, physical_ms
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64"})


class WindowOracle(TimestampOracle):
    """The oracle before one clock: a window of `window_ms` persisted ahead (the end of
    it, physical ms), timestamps issued inside it; a new one starts past the window the
    last one persisted."""

    def __init__(self, store: MetaStore, key: str, window_ms: int = 3000) -> None:
        super().__init__(store, key)
        self.window_ms = window_ms
        self._last = 0
        self._limit = 0
        self._floor = 0

    def alloc(self, count: int = 1, above: int = 0) -> int:
        with self._lock:
            candidate = max(compose_ts(int(time.time() * 1000)), self._last + 1, above + 1)
            last = candidate + count - 1
            if (last >> LOGICAL_BITS) >= self._limit:
                self._extend(last >> LOGICAL_BITS)
                candidate = max(candidate, compose_ts(self._floor))
                last = candidate + count - 1
            self._last = last
            return last

    def _extend(self, physical_needed: int) -> None:
        while True:
            kv = self.store.get(self.key)
            mark, version = (int(kv.value), kv.version) if kv else (0, 0)
            self._floor = max(mark, self._limit)
            limit = max(physical_needed, mark) + self.window_ms
            try:
                self.store.cas(self.key, version, str(limit).encode())
            except CasConflictError:
                continue
            self._limit = limit
            return


class VersionSwapOracle(TimestampOracle):
    """One clock with a compare-and-swap on the version this oracle last saw (its first
    form): any allocation by another oracle since costs a second round trip."""

    def alloc(self, count: int = 1, above: int = 0) -> int:
        with self._lock:
            kv = self.store.get(self.key) if self._version is None else None
            mark = int(kv.value) if kv else self._last
            version = kv.version if kv else (self._version or 0)
            while True:
                first = max(compose_ts(int(time.time() * 1000)), mark + 1, above + 1)
                last = first + count - 1
                written, found = self.store.try_swap(self.key, version, str(last).encode())
                if written:
                    self._last, self._version = last, version + 1
                    return last
                self.conflicts += 1
                mark, version = (int(found.value), found.version) if found else (0, 0)

    _last = 0
    _version: int | None = None


Make = Callable[[MetaStore, str], TimestampOracle]
DESIGNS: dict[str, Make] = {
    "window (before)": lambda store, key: WindowOracle(store, key),
    "one clock, version swap": lambda store, key: VersionSwapOracle(store, key),
    "one clock": lambda store, key: TimestampOracle(store, key),
}


def allocations(make: Make, stores: list[MetaStore], key: str, n: int) -> tuple[float, float]:
    """Allocations per second of one oracle per store, side by side, `n` each; and the
    allocations retried after a conflict, per allocation."""
    oracles = [make(s, key) for s in stores]
    start = threading.Barrier(len(oracles) + 1)

    def run(oracle: TimestampOracle) -> None:
        start.wait()
        for _ in range(n):
            oracle.now()

    threads = [threading.Thread(target=run, args=(o,)) for o in oracles]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    total = n * len(oracles)
    return total / (time.perf_counter() - began), sum(o.conflicts for o in oracles) / total


def insert_seconds(producers: dict[str, tuple[Producer, str]], inserts: int, rows: int) -> dict[str, float]:
    """Median seconds of one `Producer.insert` of `rows` rows, per design: the designs'
    inserts alternate one by one."""
    batch = generate_rows(SCHEMA, rows, seed=0)
    times: dict[str, list[float]] = {d: [] for d in producers}
    for _ in range(inserts):
        for design, (producer, collection) in producers.items():
            began = time.perf_counter()
            producer.insert(collection, batch)
            times[design].append(time.perf_counter() - began)
    return {d: statistics.median(t) for d, t in times.items()}


def window_now(store: MetaStore, key: str) -> int:
    """A read's "now" before one clock: the wall clock, or the window persisted (a read)."""
    kv = store.get(key)
    return max(compose_ts(int(time.time() * 1000)), compose_ts(int(kv.value)) - 1 if kv else 0)


def reads_now_ms(store: MetaStore, key: str, calls: int) -> dict[str, float]:
    """Median milliseconds of a read's "now", before (one get) and with one clock (one
    compare-and-swap: `now_ts`), alternating."""
    times: dict[str, list[float]] = {"window (before)": [], "one clock": []}
    for _ in range(calls):
        for design, call in (
            ("window (before)", lambda: window_now(store, key)),
            ("one clock", lambda: now_ts(store)),
        ):
            began = time.perf_counter()
            call()
            times[design].append(1000 * (time.perf_counter() - began))
    return {d: statistics.median(t) for d, t in times.items()}


def ahead_after_starts(make: Make, store: MetaStore, key: str, starts: int) -> float:
    """Seconds the newest timestamp is ahead of the wall clock after `starts` oracles,
    each issuing one timestamp."""
    ts = 0
    for _ in range(starts):
        ts = make(store, key).now()
    return physical_ms(ts) / 1000 - time.time()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench.clock", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--allocations", type=int, default=3000)
    parser.add_argument("--inserts", type=int, default=300)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--starts", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="bench_clock.json", help="the run's figures as JSON")
    args = parser.parse_args()
    figures: dict[str, dict[str, list[float]]] = {d: {} for d in DESIGNS}

    def record(design: str, name: str, value: float) -> None:
        figures[design].setdefault(name, []).append(value)

    with bench_system("vchan-bench-clock-") as (_, system):
        store = system.store
        second = MetaStore.connect(system.settings)
        producers = {}
        for i, (design, make) in enumerate(DESIGNS.items()):
            oracle = make(store, f"{store.keys.root}/bench/insert-{i}")
            producer = Producer(system, tso=oracle)
            producer.create_collection(f"c{i}", SCHEMA, num_channels=2)
            producers[design] = (producer, f"c{i}")
        try:
            for r in range(args.repeat):
                for i, (design, make) in enumerate(DESIGNS.items()):
                    key = f"{store.keys.root}/bench/{r}-{i}"
                    rate, _ = allocations(make, [store], key, args.allocations)
                    record(design, "allocations/s, 1 oracle", rate)
                    rate, conflicts = allocations(make, [store, second], key + "p", args.allocations // 2)
                    record(design, "allocations/s, 2 oracles side by side", rate)
                    record(design, "conflicts per allocation, 2 oracles", conflicts)
                    ahead = ahead_after_starts(make, store, key + "s", args.starts)
                    record(design, f"s ahead after {args.starts} starts", ahead)
                for design, seconds in insert_seconds(producers, args.inserts, args.rows).items():
                    record(design, "ms per insert", 1000 * seconds)
                for design, ms in reads_now_ms(store, f"{store.keys.root}/bench/{r}-0", args.inserts).items():
                    record(design, "ms per read's now", ms)
                print(f"round {r + 1}: load average {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            second.close()
            for producer, _ in producers.values():
                producer.close()
    report = {d: {k: statistics.median(v) for k, v in f.items()} for d, f in figures.items()}
    for design, values in report.items():
        print(f"{design}: " + ", ".join(f"{k} {v:,.3f}" for k, v in values.items()))
    paired = [
        a - b
        for a, b in zip(
            figures["one clock"]["ms per insert"], figures["window (before)"]["ms per insert"], strict=True
        )
    ]
    added = statistics.median(paired)
    print(f"one clock adds {added:.3f} ms per insert call (median of the rounds' differences {paired})")
    with open(args.out, "w") as out:
        json.dump(
            {"args": vars(args), "rounds": figures, "medians": report, "ms added per insert": added},
            out,
            indent=2,
        )


if __name__ == "__main__":
    main()
