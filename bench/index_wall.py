"""`vchan create-index --wait` against faiss alone, at 3 segments and at 10.

    .venv/bin/python -m bench.index_wall [--rows-per-segment 100000] [--counts 3 10] [--engine spark]

For each count, a collection of one vchannel holding that many sorted segments of
`--rows-per-segment` clustered 128-d vectors (loaded, synced and sorted before anything is
timed). Then, on the same segments, in this order:

- ours: the wall time of `vchan create-index --collection C --field vec --type HNSW
  --param M=16 --param efConstruction=200 --wait --engine E`, a new process as a user runs
  it (its start, its Spark session for `--engine spark`, each build reading its segment's
  vectors from the binlogs, writing its index file and committing it);
- faiss alone: the same HNSW indexes built in this process from numpy arrays, one segment
  after the other, each with every core (`omp_set_num_threads(cores)`), no I/O.

Ratio faiss / ours (target >= 0.9: ours at least 90% of faiss' speed), with the load
average beside each. The builds share the cores in waves (`indexes.build.waves`): side by
side one thread each while they fill every core, and a last wave that would leave cores
idle (the third of 3 builds on 2 cores) splits them.

Results: bench/results/index_wall.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import faiss

from bench import bench_system, write_report
from bench.index_build import EF_CONSTRUCTION, M, clustered, faiss_builds, load, segment_pks, sorted_segments
from vchan_assets.catalog import Catalog
from vchan_assets.system import System
from vchan_assets.testing.harness import cli_env

VCHAN = Path(sys.executable).parent / "vchan"


def ours(system: System, collection: str, engine: str) -> tuple[float, str]:
    """Seconds of one `vchan create-index --wait`, and its output."""
    command = [
        str(VCHAN), "create-index", "--collection", collection, "--field", "vec", "--type", "HNSW",
        "--param", f"M={M}", "--param", f"efConstruction={EF_CONSTRUCTION}", "--wait", "--engine", engine,
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, env=cli_env(system.settings), capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows-per-segment", type=int, default=100_000)
    parser.add_argument("--counts", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--engine", choices=["spark", "local"], default="spark")
    parser.add_argument("--out", default="bench/results/index_wall.json")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    with bench_system("vchan-index-wall-") as (_, system):
        catalog = Catalog(system)
        for count in args.counts:
            vectors = clustered(count * args.rows_per_segment, seed=count)
            print(f"{count} segments of {args.rows_per_segment:,} vectors: loading", flush=True)
            info = load(system, vectors, count)
            segments = sorted_segments(system, info)
            assert len(segments) == count, [s.id for s in segments]
            pk_lists = [segment_pks(catalog, info, s) for s in segments]
            ours_s, out = ours(system, info.name, args.engine)
            load_ours = os.getloadavg()[0]
            faiss_s = faiss_builds(vectors, pk_lists)
            load_faiss = os.getloadavg()[0]
            print(out.strip(), flush=True)
            row = {
                "segments": count,
                "rows": len(vectors),
                "ours_s": round(ours_s, 2),
                "faiss_s": round(faiss_s, 2),
                "ratio_faiss_over_ours": round(faiss_s / ours_s, 3),
                "load_1m_after_ours": round(load_ours, 1),
                "load_1m_after_faiss": round(load_faiss, 1),
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    write_report(
        args.out,
        {
            "engine": args.engine,
            "index": f"HNSW M={M} efConstruction={EF_CONSTRUCTION}",
            "rows_per_segment": args.rows_per_segment,
            "cores": os.cpu_count(),
            "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
            "faiss": faiss.__version__,
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()
