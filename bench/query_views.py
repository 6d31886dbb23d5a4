"""The query views of a collection's vchannels over one listing of its segments
(`query.view.collection_views`, what a search's or a read's plan builds): the same segments
spread over more vchannels should cost the same, not a pass over the collection per vchannel.

    .venv/bin/python -m bench.query_views [--segments 100000] [--vchannels 2 32 256]

N synthetic flushed, sorted segments (`testing.steps.flushed_segment`: realistic records),
their checkpoints and the collection's indexes given: no etcd, the views' Python alone. The
best and the median of 5 per vchannel count, with Python's garbage collector off (as `timeit`); the ratio of each to the fewest vchannels'.

Results: bench/results/query_views.json (or `--out`).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from types import SimpleNamespace

from bench import write_report
from vchan_assets.model import CollectionInfo, MsgPosition
from vchan_assets.query.view import collection_views
from vchan_assets.testing.harness import SCHEMA
from vchan_assets.testing.steps import flushed_segment

REPEAT = 5


def timed(segments: int, vchannels: int) -> dict[str, float | int]:
    names = tuple(f"c-dml_{i}_1v{i}" for i in range(vchannels))
    info = CollectionInfo(id=1, name="c", schema=SCHEMA, partitions=(2,), vchannels=names)
    shape = SimpleNamespace(id=1, partitions=[2], schema=SCHEMA)  # what flushed_segment reads
    found = [flushed_segment(shape, names[i % vchannels], 10_000_000 + i) for i in range(segments)]  # type: ignore[arg-type]
    checkpoints = {v: MsgPosition(v, 10**9, 2**62) for v in names}
    seconds = []
    gc.collect()
    gc.disable()  # (as timeit does: a full collection over the records is not the views' cost)
    try:
        for _ in range(REPEAT):
            started = time.perf_counter()
            views = collection_views(None, info, found, checkpoints, None, [])  # type: ignore[arg-type]
            seconds.append(time.perf_counter() - started)
    finally:
        gc.enable()
    assert sum(len(v.flushed) for v in views) == segments
    return {
        "segments": segments,
        "vchannels": vchannels,
        "best_ms": round(min(seconds) * 1000, 1),
        "median_ms": round(statistics.median(seconds) * 1000, 1),
        "load_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--vchannels", type=int, nargs="+", default=[2, 32, 256])
    parser.add_argument("--out", default="bench/results/query_views.json")
    args = parser.parse_args()
    rows = []
    for v in sorted(args.vchannels):
        rows.append(timed(args.segments, v))
        print(f"  {rows[-1]}", flush=True)
    base = rows[0]["best_ms"]
    ratios = {
        f"{r['vchannels']}_over_{rows[0]['vchannels']}": round(r["best_ms"] / base, 2) for r in rows[1:]
    }
    print(f"best time over the fewest vchannels': {ratios}")
    write_report(args.out, {"rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
