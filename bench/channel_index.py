"""A vchannel's listing and sync beside a collection of many segments: the per-vchannel
segment index against the collection's listing filtered (what every sync did before it).

    .venv/bin/python -m bench.channel_index [--sizes 1000 20000 100000] [--old-up-to 20000]
        [--plan-up-to 100000]

A collection of 2 vchannels and 2 partitions on a real etcd: 200 rows in `_default` and 200
in a second partition, flushed and synced (a segment of each partition on each vchannel);
then vchannel B gets N synthetic flushed segments in `_default` (realistic values, ~1.9 KB
each, written straight to etcd with their index entries). For each N, on A:

- its listing, `SegmentMeta(store).list(collection, vchannel=A)`: the keys and bytes etcd
  returned (`MetaStore.keys_read`, `bytes_read`) and the seconds;
- a sync of 100 new rows (`SyncTask`, engine local): the same figures for the whole sync;
- its query view (`read_query_view(store, info, A)`, what the view sensor and a read of one
  vchannel build): the same figures;
- through the index only, for N up to `--plan-up-to`: a search's plan of the collection
  (`meta_at` at a new timestamp: every live segment of both vchannels, the Dropped ones and
  the index builds, at one revision): the same figures. A search covers every segment of the
  collection, so this one grows with N;
- the same plan pruned to one partition (`meta_at(..., partitions=...)`, what a search whose
  filter names a partition key's value plans): the collection's second partition holds 200
  rows (synced with A's) and none of B's N segments, which are in `_default`.
- the whole plan again through a store that holds the segment meta in memory
  (`Catalog.hold_segment_meta`, the DataCoord's `SegmentCache`): the copy's load, its
  first plan (which decodes every record once), a plan with every vchannel planned again
  (the plans kept between reads forgotten: `query.channel_plans`), a repeated plan (both
  vchannels' plans kept) and a plan after a sync of 100 rows on A (A planned again, B's
  kept: what a catalog serving repeated searches pays under ingest).

Both through the index, and for N up to `--old-up-to` through the collection's listing
(the index's mark removed: how a stack without the index reads). The target:
a vchannel's sync at the largest N within 1.3x of the same at 1,000 segments.

Results: bench/results/channel_index.json (or `--out`).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from dataclasses import replace
from typing import Any

from bench import bench_system, write_report
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.segment_cache import SegmentCache
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.query.asof import meta_at, resolve_as_of
from vchan_assets.query.channel_plans import held_plans
from vchan_assets.query.view import read_query_view
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced, produce
from vchan_assets.testing.steps import sync_all, write_segments
from vchan_assets.wal.producer import Producer, generate_rows

# The partition the pruned plan reads: 200 rows, none of B's segments.
TENANT = "tenant"


def measured(store: MetaStore, work: Any) -> tuple[int, int, float]:
    """(keys, bytes, seconds) of `work()`."""
    keys, read, started = store.keys_read, store.bytes_read, time.perf_counter()
    work()
    return store.keys_read - keys, store.bytes_read - read, time.perf_counter() - started


def one_size(system: System, n: int, old: bool, plan: bool) -> list[dict[str, Any]]:
    store = system.store
    producer = Producer(system)
    info = producer.create_collection(
        f"c{uuid.uuid4().hex[:6]}", SCHEMA, partitions=("_default", TENANT), num_channels=2
    )
    a, b = info.vchannels
    produce(producer, info.name, Produced(), 200, start_pk=0)
    producer.insert(info.name, generate_rows(SCHEMA, 200, start_pk=500_000), partition=TENANT)
    producer.flush(info.name)
    sync_all(system, info)
    started = time.perf_counter()
    meta_bytes = write_segments(store, info, b, n)
    print(
        f"  N={n:,}: {meta_bytes / 2**20:.1f} MiB of segment meta on B in {time.perf_counter() - started:.0f}s"
    )
    mark = store.keys.channel_segment_index()
    marker = store.get(mark)
    assert marker is not None
    rows: list[dict[str, Any]] = []
    for path in ("index", "collection listing") if old else ("index",):
        if path == "index":
            store.put(mark, marker.value)
        else:
            store.delete(mark)
        listing = measured(store, lambda: SegmentMeta(store).list(info.id, vchannel=a))
        produce(producer, info.name, Produced(), 100, start_pk=1_000_000 + len(rows) * 1_000)
        lease = store.read_lease(a)
        assert lease is not None
        task = SyncTask(system, info, a, lease, engine="local")
        sync = measured(store, task.run)
        view = measured(store, lambda: read_query_view(store, info, a))
        planned = (
            measured(
                store, lambda: meta_at(store, info, resolve_as_of(store, system.settings, None), builds=True)
            )
            if plan and path == "index"
            else None
        )
        pruned = (
            measured(
                store,
                lambda: meta_at(
                    store,
                    info,
                    resolve_as_of(store, system.settings, None),
                    builds=True,
                    partitions={info.partitions[1]},
                ),
            )
            if plan and path == "index"
            else None
        )
        held = held_plan(system, info, producer) if plan and path == "index" else None
        row = {
            "segments_on_b": n,
            "segment_meta_mib": round(meta_bytes / 2**20, 1),
            "path": path,
            "listing_keys": listing[0],
            "listing_bytes": listing[1],
            "listing_ms": round(listing[2] * 1000, 1),
            "sync_keys": sync[0],
            "sync_bytes": sync[1],
            "sync_ms": round(sync[2] * 1000, 1),
            "view_keys": view[0],
            "view_bytes": view[1],
            "view_ms": round(view[2] * 1000, 1),
            **(
                {"plan_keys": planned[0], "plan_bytes": planned[1], "plan_ms": round(planned[2] * 1000, 1)}
                if planned
                else {}
            ),
            **(
                {
                    "pruned_plan_keys": pruned[0],
                    "pruned_plan_bytes": pruned[1],
                    "pruned_plan_ms": round(pruned[2] * 1000, 1),
                }
                if pruned
                else {}
            ),
            **(held or {}),
            "load_1m": round(os.getloadavg()[0], 1),
        }
        print(f"    {row}", flush=True)
        rows.append(row)
    store.put(mark, marker.value)
    return rows


def held_plan(system: System, info: Any, producer: Producer, repeats: int = 5) -> dict[str, Any]:
    """The collection's plan through a store holding the segment cache: the seconds the copy
    took to load, then (keys, bytes, ms) of its first plan (every record decoded, every
    vchannel planned), of a plan with every vchannel planned again (the kept plans
    forgotten: what each plan cost before they were kept), of a repeated plan (nothing
    changed: both vchannels' plans kept) and of a plan after a sync of 100 rows on A (A
    planned again, B's kept); the last two the median of `repeats`."""
    store = MetaStore.connect(system.settings)
    started = time.perf_counter()
    cache = SegmentCache(store).start()
    a = info.vchannels[0]
    try:
        assert cache.wait_loaded(600), "the segment cache did not load"
        store.segment_cache = cache
        load = time.perf_counter() - started

        def plan() -> None:
            meta_at(store, info, resolve_as_of(store, system.settings, None), builds=True)

        def replanned() -> None:
            held_plans(cache).clear()
            plan()

        def median(samples: list[tuple[int, int, float]]) -> tuple[int, int, float]:
            return sorted(samples, key=lambda m: m[2])[len(samples) // 2]

        first = measured(store, plan)
        every = measured(store, replanned)
        kept = median([measured(store, plan) for _ in range(repeats)])
        after_sync = []
        for i in range(repeats):
            produce(producer, info.name, Produced(), 100, start_pk=5_000_000 + i * 1_000)
            lease = system.store.read_lease(a)
            assert lease is not None
            SyncTask(system, info, a, lease, engine="local").run()
            after_sync.append(measured(store, plan))
        synced = median(after_sync)
        figures = {"first": first, "every_vchannel": every, "kept": kept, "after_a_sync": synced}
        return {
            "held_load_s": round(load, 2),
            **{
                f"held_plan_{name}_{what}": round(value * 1000, 1) if what == "ms" else value
                for name, m in figures.items()
                for what, value in zip(("keys", "bytes", "ms"), m, strict=True)
            },
        }
    finally:
        cache.stop()
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 20_000, 100_000])
    parser.add_argument("--old-up-to", type=int, default=20_000, help="the largest N read the old way too")
    parser.add_argument("--plan-up-to", type=int, default=100_000, help="the largest N a search plans")
    parser.add_argument("--out", default="bench/results/channel_index.json")
    args = parser.parse_args()
    with bench_system("vchan-channel-index-") as (_, opened):
        system = replace(opened, settings=replace(opened.settings, sync_in_process_mb=32.0))
        SegmentMeta(system.store).backfill_channel_index()  # the mark, as a DataCoord's first tick writes it
        rows = [
            r
            for n in args.sizes
            for r in one_size(system, n, old=n <= args.old_up_to, plan=n <= args.plan_up_to)
        ]
    by_size = {r["segments_on_b"]: r for r in rows if r["path"] == "index"}
    smallest, largest = min(by_size), max(by_size)
    ratios = {
        f"{what}_ratio_largest_over_smallest": round(by_size[largest][key] / by_size[smallest][key], 3)
        for what, key in (
            ("sync", "sync_ms"),
            ("view", "view_ms"),
            ("plan", "plan_ms"),
            ("pruned_plan", "pruned_plan_ms"),
            ("held_plan_every_vchannel", "held_plan_every_vchannel_ms"),
            ("held_plan_kept", "held_plan_kept_ms"),
            ("held_plan_after_a_sync", "held_plan_after_a_sync_ms"),
        )
        if key in by_size[largest] and key in by_size[smallest]
    }
    print(f"A at {largest:,} / at {smallest:,} segments on B: {ratios}")
    write_report(args.out, {"rows": rows, **ratios, "sizes": [smallest, largest]})


if __name__ == "__main__":
    main()
