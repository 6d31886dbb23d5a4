"""Run every benchmark: `python -m bench` (what `make bench` calls).

Each one can also run alone: `python -m bench.sync`, `python -m bench.failover`,
`python -m bench.latency` (the Dagster per-change latency, when present).
"""

import importlib
import sys

BENCHMARKS = ("sync", "failover", "latency", "compaction", "lifecycle_soak", "import", "scale")

if __name__ == "__main__":
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError:
            continue
        print(f"\n=== bench.{name} ===", flush=True)
        sys.argv = [f"bench.{name}"]
        module.main()
