"""Run every benchmark: `python -m bench` (what `make bench` calls).

Each one can also run alone: `python -m bench.sync`, `python -m bench.failover`,
`python -m bench.latency` (the Dagster per-change latency, when present).
`python -m bench --with-10m` (`make bench ARGS=--with-10m`) adds the 10,000,000-row size
to bench.sync. `python -m bench stream pushdown` runs only the benchmarks named (any module
of bench/, also those `make bench` leaves out: `stream`, `pushdown`, `read`, ...), each with
its defaults.
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
    "clock",
    "sensor_ticks",
    "idle_stack",
    "instance_open",
)

if __name__ == "__main__":
    with_10m = "--with-10m" in sys.argv[1:]
    named = [a for a in sys.argv[1:] if not a.startswith("-")]
    for name in named or BENCHMARKS:
        try:
            module = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError:
            if named:  # asked for by name: say it is not there
                raise
            continue
        print(f"\n=== bench.{name} ===", flush=True)
        sys.argv = [f"bench.{name}", *(["--with-10m"] if with_10m and name == "sync" else [])]
        module.main()
