"""What opening the Dagster instance and a sensor tick's queries cost, with Dagster's SQLite
storage and with `vchan up`'s.

    .venv/bin/python -m bench.instance_open [--opens 30] [--repeat 3]

Dagster's code server opens the instance (`DagsterInstance.from_ref`) for every evaluation
of a sensor that has resources; four of ours tick every second, and the daemon and the
nodes' sync loops query the same storage between. This opens the instance of one scratch
DAGSTER_HOME (this project's dagster.yaml, 20 runs in it) `--opens` times and asks it what
a tick asks (the runs in flight of a job, the sensors' states, the dynamic partitions):
with Dagster's default storage (no `storage:` section), with Dagster's `storage: sqlite:`,
and with `vchan up`'s (`defs/instance_storage.py`: the same files; the schema checked at
the first opening in a process only, one SQLAlchemy engine per database, schema questions
answered true kept). It also asks the same on an instance kept open, with Dagster's
storage and with `vchan up`'s: what the daemon and a sync loop pay per query. The designs
alternate within each of `--repeat` rounds; the figure is CPU milliseconds per call
(medians).
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import dagster as dg
from dagster._core.instance.ref import InstanceRef

from bench import bench_parser, write_report
from vchan_assets.defs.sync.sensor import busy_channels
from vchan_assets.deploy.service import INSTANCE_CONFIG, local_storage, write_instance_config
from vchan_assets.testing.dagster_jobs import one_op


def cpu_ms(call: Callable[[], object], n: int) -> float:
    started = time.process_time()
    for _ in range(n):
        call()
    return 1000 * (time.process_time() - started) / n


def main() -> None:
    parser = bench_parser(__doc__, 0, "bench/results/instance_open.json")
    parser.add_argument("--opens", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="vchan-bench-instance-"))
    try:
        homes = {
            "Dagster's default storage": scratch / "default",
            "Dagster's SQLite storage": scratch / "dagster",
            "vchan up's SQLite storage": scratch / "vchan",
        }
        homes["Dagster's default storage"].mkdir()
        # Without a storage: section, as `vchan up` wrote dagster.yaml before.
        shutil.copy(INSTANCE_CONFIG, homes["Dagster's default storage"] / "dagster.yaml")
        write_instance_config(
            homes["Dagster's SQLite storage"], {"sqlite": {"base_dir": str(scratch / "dagster")}}
        )
        write_instance_config(
            homes["vchan up's SQLite storage"], local_storage(homes["vchan up's SQLite storage"])
        )
        refs = {name: InstanceRef.from_dir(str(home)) for name, home in homes.items()}
        for ref in refs.values():
            with dg.DagsterInstance.from_ref(ref) as instance:
                for _ in range(20):
                    assert one_op.execute_in_process(instance=instance).success

        def tick(instance: dg.DagsterInstance) -> None:
            assert not busy_channels(instance)
            instance.all_instigator_state()
            assert instance.get_dynamic_partitions("vchannels") == []

        def opening(ref: InstanceRef) -> Callable[[], object]:
            def call() -> None:
                with dg.DagsterInstance.from_ref(ref) as instance:
                    tick(instance)

            return call

        kept = {
            name: dg.DagsterInstance.from_ref(refs[name])
            for name in ("Dagster's SQLite storage", "vchan up's SQLite storage")
        }
        designs = {name: opening(ref) for name, ref in refs.items()}
        for name, instance in kept.items():
            designs[f"kept open, {name}"] = functools.partial(tick, instance)
        rounds: dict[str, list[float]] = {name: [] for name in designs}
        for _ in range(args.repeat):
            for name, call in designs.items():
                rounds[name].append(cpu_ms(call, args.opens))
        for instance in kept.values():
            instance.dispose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    for name, value in medians.items():
        print(f"{name:34s} {value:6.1f} ms CPU (rounds {[round(v, 1) for v in rounds[name]]})")
    ratio = medians["Dagster's SQLite storage"] / medians["vchan up's SQLite storage"]
    kept_ratio = (
        medians["kept open, Dagster's SQLite storage"] / medians["kept open, vchan up's SQLite storage"]
    )
    print(f"an opening and a tick with Dagster's storage over vchan up's: {ratio:.1f}x")
    print(f"a tick on an instance kept open, Dagster's storage over vchan up's: {kept_ratio:.1f}x")
    write_report(
        args.out,
        {
            "opens": args.opens,
            "repeat": args.repeat,
            "cpu_ms_median": {k: round(v, 2) for k, v in medians.items()},
            "cpu_ms_rounds": {k: [round(v, 2) for v in vs] for k, vs in rounds.items()},
            "dagster_over_vchan": round(ratio, 2),
            "kept_open_dagster_over_vchan": round(kept_ratio, 2),
        },
    )


if __name__ == "__main__":
    main()
