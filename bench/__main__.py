"""Run every benchmark: `python -m bench` (what `make bench` calls).

Each one can also run alone: `python -m bench.sync`, `python -m bench.failover`,
`python -m bench.latency` (the Dagster per-change latency, when present).
`python -m bench --with-10m` (`make bench ARGS=--with-10m`) adds the 10,000,000-row size
to bench.sync.
"""

import importlib
import sys

BENCHMARKS = (
    "sync",
    "failover",
    "rolling",
    "latency",
    "compaction",
    "lifecycle_soak",
    "sort_vs_ingest",
    "read_tail",
    "import",
    "scale",
    "overload",
)

if __name__ == "__main__":
    with_10m = "--with-10m" in sys.argv[1:]
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError:
            continue
        print(f"\n=== bench.{name} ===", flush=True)
        sys.argv = [f"bench.{name}", *(["--with-10m"] if with_10m and name == "sync" else [])]
        module.main()
