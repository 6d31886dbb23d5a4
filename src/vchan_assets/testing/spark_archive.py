"""A class-data-sharing archive of the classes a Spark driver JVM loads, for the tests' JVMs.

A Spark driver spends most of its start loading, verifying and linking some ten thousand
classes from its jars. Java's class-data sharing (CDS) keeps them parsed in an archive that
a JVM maps instead: `python -m vchan_assets.testing.spark_archive` starts a local session,
runs what the product's jobs run (an RDD job of Python tasks, `mapInArrow`, Arrow in and
out, Parquet written and read) and leaves the classes it loaded in `ARCHIVE`, beside this
virtualenv's Spark (`make test` makes it once per install).

`fixtures.py` then gives every Spark JVM of a test run `-XX:SharedArchiveFile` through
SPARK_SUBMIT_OPTS. A JVM that cannot use the archive (none made yet, another Java build,
another class path) says nothing and loads its classes from the jars as before: the archive
changes how fast a JVM starts (docs/testing.md has the figures), never what it does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# In the virtualenv (sys.prefix): made for its pyspark's jars, gone with it.
ARCHIVE = Path(sys.prefix) / "spark-classes.jsa"
# The tests' JVMs: C1 only and the serial GC (fixtures.py says why).
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def submit_options(archive: Path = ARCHIVE) -> str:
    """SPARK_SUBMIT_OPTS for a test's Spark JVM: `JVM_OPTIONS` and the archive. The JVM
    looks for the archive as it starts, so one made while a run is under way serves its
    later JVMs; its CDS log is off, or a JVM that cannot use the archive would say so on
    its stdout (a `vchan` command's output)."""
    return f"{JVM_OPTIONS} -XX:SharedArchiveFile={archive} -Xlog:cds=off -Xlog:cds+dynamic=off"


def _workload() -> None:
    """What the archive's JVM runs: the kinds of job the product's syncs, imports,
    compactions, index builds and reads start (the classes they load are archived)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the Python workers: this venv's
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    sc.parallelize(range(4), 2).mapPartitions(lambda xs: [sum(xs)]).collect()

    def body(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield pa.RecordBatch.from_pydict(
                {"id": batch.column(0), "twice": pc.multiply(batch.column(0), 2)}
            )

    frame = spark.range(100, numPartitions=2).mapInArrow(body, "id long, twice long")
    with tempfile.TemporaryDirectory() as scratch:
        frame.write.parquet(f"{scratch}/t")
        read = spark.read.parquet(f"{scratch}/t")
        read.where("twice > 10").groupBy((read.id % 3).alias("k")).count().toArrow()
    spark.createDataFrame(pa.table({"x": [1, 2], "y": ["a", "b"]}).to_pandas()).toPandas()
    spark.stop()
    # The JVM writes the archive as it exits, which it does when its stdin closes: wait for
    # it, or the caller could find no archive yet.
    jvm = SparkContext._gateway.proc  # type: ignore[union-attr]
    jvm.stdin.close()
    jvm.wait(timeout=600)


def make(archive: Path = ARCHIVE) -> Path:
    """Run the workload in a Spark JVM that writes its classes to `archive` as it exits
    (written beside it, then renamed: a JVM never maps half an archive)."""
    partial = archive.with_name(f".{archive.name}.{os.getpid()}")
    env = {**os.environ, "SPARK_SUBMIT_OPTS": f"{JVM_OPTIONS} -XX:ArchiveClassesAtExit={partial}"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from vchan_assets.testing.spark_archive import _workload; _workload()"],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not partial.is_file():
            raise RuntimeError(f"no archive written (exit {done.returncode}):\n{done.stderr[-3000:]}")
        partial.replace(archive)
    finally:
        partial.unlink(missing_ok=True)  # interrupted or failed: no half archive left behind
    return archive


def main() -> int:
    """Make the archive unless it exists (`make test` runs this beside the tests)."""
    if ARCHIVE.is_file():
        return 0
    started = time.monotonic()
    try:
        make()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"Spark class archive not made, the tests' JVMs load their classes from the jars: {exc}")
        return 1
    print(f"Spark class archive made in {time.monotonic() - started:.0f}s: {ARCHIVE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
