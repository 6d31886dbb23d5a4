"""A read at a timestamp with a log tail against today's read of persisted rows.

    .venv/bin/python -m bench.read_tail [--rows 1000000] [--tail 100000] [--repeat 5] [--no-spark]

Two collections of the same schema (int64 pk, a 32-d float32 vector, three scalars) in two
vchannels, on one scratch etcd and storage directory (`bench.compaction.make_segments`:
6 flushed segments per vchannel, 1% of the pks deleted, synced):

- **persisted**: N rows, every one in binlogs, read now (`as_of` not given): today's read;
- **tail**: N - `--tail` rows built the same way, then `--tail` more rows (and the delete
  of 1% of them) inserted after the last sync, so they are only in the log after the
  checkpoint (in growing segments without binlogs); read at T, the timestamp of the last
  append (`as_of=T`): the segments the query views serve plus the log tail.

Both hold the same number of live rows (to a few: 6 segments per vchannel). Measured in the
same run, after one untimed read each, interleaved, `--repeat` times each, medians:

- `Catalog.read_collection(name, as_arrow=True)` (the Arrow table: reading and deletes,
  no pandas conversion) and `Catalog.read_collection(name)` (the pandas DataFrame);
- `spark.read.format("vchan")` (`Catalog.spark_collection`, `.option("as_of", T)` for the
  tail) written to Spark's `noop` sink, on a local session warmed by a count of each.

Reports seconds, rows/s and the ratio tail / persisted (the target: <= 1.3), and the
1-minute load average before and after. `--profile` adds a cProfile of one tail read
and one persisted read (the functions with the most cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench import bench_system, write_report
from bench.compaction import SCHEMA, make_segments
from vchan_assets.catalog import Catalog
from vchan_assets.model import CollectionInfo
from vchan_assets.spark.session import get_spark
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

BATCH = 100_000


def with_tail(producer: Producer, system: System, rows: int, tail: int) -> tuple[CollectionInfo, int]:
    """`rows - tail` rows persisted as `make_segments` does, then `tail` rows (1% of them
    deleted) appended after the last sync; and the timestamp of the last append."""
    info = make_segments(producer, system.store, system.storage, system.settings, rows - tail)
    last = 0
    for start in range(rows - tail, rows, BATCH):
        n = min(BATCH, rows - start)
        appended = producer.insert(info.name, generate_rows(SCHEMA, n, start_pk=start, seed=start))
        last = max([last, *(a.timestamp for a in appended.values())])
    appended = producer.delete(info.name, list(range(rows - tail, rows, 100)), partition="_default")
    return info, max([last, *(a.timestamp for a in appended.values())])


def arrow(catalog: Catalog, info: CollectionInfo, as_of: int | None) -> Callable[[], int]:
    return lambda: catalog.read_collection(info.name, as_arrow=True, as_of=as_of).num_rows


def pandas(catalog: Catalog, info: CollectionInfo, as_of: int | None) -> Callable[[], int]:
    return lambda: len(catalog.read_collection(info.name, as_of=as_of))


def as_of_option(as_of: int | None) -> dict[str, str]:
    return {"as_of": str(as_of)} if as_of else {}


def spark_noop(catalog: Catalog, spark: Any, info: CollectionInfo, as_of: int | None) -> Callable[[], int]:
    """`format("vchan")` written to the noop sink: every row read and converted, nothing collected."""

    def read() -> int:
        df = catalog.spark_collection(info.name, spark=spark, **as_of_option(as_of))
        df.write.format("noop").mode("overwrite").save()
        return 0

    return read


def interleaved(reads: dict[str, Callable[[], int]], repeat: int) -> dict[str, tuple[float, int]]:
    """Each read once untimed, then `repeat` times round-robin (a change of load hits all
    of them), every other round in reverse order (neither runs always first): the median
    seconds and the rows it returned."""
    runs: dict[str, list[float]] = {name: [] for name in reads}
    rows = {name: read() for name, read in reads.items()}
    for r in range(repeat):
        for name, read in reads.items() if r % 2 == 0 else reversed(reads.items()):
            started = time.perf_counter()
            rows[name] = read()
            runs[name].append(time.perf_counter() - started)
    return {name: (statistics.median(runs[name]), rows[name]) for name in reads}


def profile(read: Callable[[], int], top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.runcall(read)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of each collection")
    parser.add_argument(
        "--tail", type=int, default=100_000, help="rows of the tail collection only in the log"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-spark", action="store_true", help="skip the Spark data source")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one read of each (Arrow)")
    parser.add_argument("--out", default="bench/results/read_tail.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"rows": args.rows, "tail_rows": args.tail, "repeat": args.repeat}
    with bench_system("vchan-bench-read-tail-") as (_, system):
        catalog, producer = Catalog(system), Producer(system)
        persisted = make_segments(producer, system.store, system.storage, system.settings, args.rows)
        tail, ts = with_tail(producer, system, args.rows, args.tail)
        report["as_of"] = ts
        reads = {
            "persisted arrow": arrow(catalog, persisted, None),
            "tail arrow": arrow(catalog, tail, ts),
            "persisted pandas": pandas(catalog, persisted, None),
            "tail pandas": pandas(catalog, tail, ts),
        }
        if not args.no_spark:
            spark = get_spark(system.settings)
            report["spark"] = spark.version
            for name, info, as_of in (("persisted", persisted, None), ("tail", tail, ts)):
                # warms the JVM and its Python workers, untimed
                report[f"spark rows {name}"] = catalog.spark_collection(
                    info.name, spark=spark, **as_of_option(as_of)
                ).count()
                reads[f"{name} spark"] = spark_noop(catalog, spark, info, as_of)
        os.sync()
        load = os.getloadavg()[0]
        measured = interleaved(reads, args.repeat)
        report["load_avg_1m"] = (round(load, 1), round(os.getloadavg()[0], 1))
        if args.profile:
            for name, read in (
                ("persisted", arrow(catalog, persisted, None)),
                ("tail", arrow(catalog, tail, ts)),
            ):
                print(f"--- profile of one {name} read (arrow)\n{profile(read)}")
    live = {"persisted": measured["persisted arrow"][1], "tail": measured["tail arrow"][1]}
    for name, (seconds, rows) in measured.items():
        collection = name.split()[0]
        assert rows == live[collection] or "spark" in name, measured  # the Spark reads return no rows
        report[f"{name} s"] = seconds
        report[f"{name} rows/s"] = live[collection] / seconds
    assert report.get("spark rows persisted", live["persisted"]) == live["persisted"], report
    assert report.get("spark rows tail", live["tail"]) == live["tail"], report
    report["live_rows"] = live
    for kind in ("arrow", "pandas", "spark"):
        if f"tail {kind}" in measured:
            ratio = report[f"ratio tail/persisted {kind}"] = (
                measured[f"tail {kind}"][0] / measured[f"persisted {kind}"][0]
            )
            print(
                f"{kind}: persisted {measured[f'persisted {kind}'][0]:.2f}s, tail at T "
                f"{measured[f'tail {kind}'][0]:.2f}s: {ratio:.2f}x",
                flush=True,
            )
    print(f"live rows {live}; load {report['load_avg_1m']}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
