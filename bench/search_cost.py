"""The fixed cost of a `Catalog.search` call: what a call spends besides faiss.

    .venv/bin/python -m bench.search_cost [--rows 200000] [--segments 4] [--calls 100] [--batch 10]

`--rows` clustered 128-d vectors (bench.index_build's) in `--segments` sorted segments of
one vchannel, an IVF_FLAT index (nlist 256) built in process. Then `--calls` searches of
`--batch` queries each, call by call in turn: `Catalog.search` (k = 10, default nprobe),
then faiss searching the same per-segment index files loaded in this process and merging
the top 10 (what bench.index_build compares against). The fixed cost per call is the
difference of the two, in milliseconds: the mean, the median of the calls (robust to a
shared machine's load spikes), and the median in this process's CPU time (what a loaded
machine inflates least; etcd's own work is not in it); also counted per call: the etcd requests the
search made and the meta records it decoded anew (not found in the codec's cache).
`--pin-reuse S`: VCHAN_READ_PIN_REUSE for the searches; `--profile` prints the functions
a call spends the most time in (cProfile).

Results: bench/results/search_cost.json (or `--out`).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench import bench_parser, bench_system
from bench.index_build import K, clustered, faiss_search, load, sorted_segments
from vchan_assets.catalog import Catalog
from vchan_assets.indexes.build import load_index
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.step import index_step
from vchan_assets.meta import codec
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import IndexType
from vchan_assets.storage.rows import segment_rows

NLIST = 256


class Requests:
    """Counts the etcd requests a MetaStore makes (every one goes through `_call`)."""

    def __init__(self, store: MetaStore) -> None:
        self.count = 0
        call = store._call

        @contextlib.contextmanager
        def counted(operation: str) -> Iterator[None]:
            self.count += 1
            with call(operation):
                yield

        store._call = counted  # type: ignore[method-assign]


def decodes() -> int:
    """Meta records decoded anew so far (the codec's cache misses, when it has one)."""
    cached = getattr(codec, "_decoded", None)
    return cached.cache_info().misses if cached is not None else -1


def main() -> None:
    parser = bench_parser(__doc__, 200_000, "bench/results/search_cost.json")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--pin-reuse",
        type=float,
        default=None,
        help="VCHAN_READ_PIN_REUSE for the searches (default: its default)",
    )
    args = parser.parse_args()
    with bench_system("vchan-search-cost-") as (_, system):
        if args.pin_reuse is not None:
            system = replace(system, settings=replace(system.settings, read_pin_reuse=args.pin_reuse))
        vectors = clustered(args.rows, seed=1)
        queries = clustered(args.calls * args.batch, seed=2)
        print(f"loading {args.rows:,} x 128-d vectors into {args.segments} segments", flush=True)
        info = load(system, vectors, args.segments)
        create_index(system.store, info, "vec", "IVF_FLAT", "L2", {"nlist": NLIST})
        index_step(system, "local")
        segments = sorted_segments(system, info)
        builds = {b.model.segment_id: b.model for b in list_builds(system.store, info.id)}
        indexes = [
            (
                load_index(system.storage.read_bytes(builds[s.id].files[0])),
                segment_rows(system.storage, s, with_vectors=False)["pk"].to_numpy(),
            )
            for s in segments
        ]
        catalog = Catalog(system)
        catalog.search(info.name, queries[: args.batch], k=K, as_arrow=True)  # warm: files cached
        requests = Requests(system.store)
        ours_s = faiss_s = 0.0
        fixed: list[float] = []  # per call: ours - faiss
        fixed_cpu: list[float] = []  # the same in this process's CPU time
        same = 0
        decoded = decodes()
        profile = cProfile.Profile() if args.profile else None
        for start in range(0, len(queries), args.batch):
            batch = queries[start : start + args.batch]
            started, cpu = time.perf_counter(), time.process_time()
            if profile is not None:
                profile.enable()
            hits = catalog.search(info.name, batch, k=K, as_arrow=True)
            if profile is not None:
                profile.disable()
            ours, ours_cpu = time.perf_counter() - started, time.process_time() - cpu
            started, cpu = time.perf_counter(), time.process_time()
            alone = faiss_search(indexes, batch, IndexType.IVF_FLAT)
            alone_s, alone_cpu = time.perf_counter() - started, time.process_time() - cpu
            ours_s, faiss_s = ours_s + ours, faiss_s + alone_s
            fixed.append(ours - alone_s)
            fixed_cpu.append(ours_cpu - alone_cpu)
            same += int(np.array_equal(hits["pk"].to_numpy(), alone.reshape(-1)))
        calls = args.calls
        result = {
            "rows": args.rows,
            "segments": len(segments),
            "index": f"IVF_FLAT nlist={NLIST}",
            "calls": calls,
            "batch": args.batch,
            "cores": os.cpu_count(),
            "read_pin_reuse": getattr(system.settings, "read_pin_reuse", None),
            "ours_ms_per_call": round(1000 * ours_s / calls, 2),
            "faiss_ms_per_call": round(1000 * faiss_s / calls, 2),
            "fixed_ms_per_call": round(1000 * (ours_s - faiss_s) / calls, 2),
            "fixed_ms_median": round(1000 * float(np.median(fixed)), 2),
            "fixed_cpu_ms_median": round(1000 * float(np.median(fixed_cpu)), 2),
            "ratio_faiss_over_ours": round(faiss_s / ours_s, 3),
            "etcd_requests_per_call": round(requests.count / calls, 1),
            "records_decoded_per_call": round((decodes() - decoded) / calls, 1) if decoded >= 0 else None,
            "calls_with_faiss_hits": same,
            "load_1m": round(os.getloadavg()[0], 1),
        }
        print(json.dumps(result, indent=2), flush=True)
        if profile is not None:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
            print(out.getvalue())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
