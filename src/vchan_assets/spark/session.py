"""SparkSession factory: local[*] by default, a cluster master, or Spark Connect.

One session per process (getOrCreate). Settings chosen for a sync job whose input
is a handful of task descriptions and whose work happens in Python workers:
few shuffle partitions, Python worker reuse, no UI, no console progress bars.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow as pa
from pyspark.errors import PySparkRuntimeError
from pyspark.sql import SparkSession

from vchan_assets.config import Settings
from vchan_assets.errors import DeclaredError
from vchan_assets.failpoints import ENV as FAILPOINT_ENV
from vchan_assets.failpoints import MARKER_ENV as FAILPOINT_MARKER_ENV

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")


class SparkJobTimeoutError(DeclaredError, TimeoutError):
    """A Spark job did not finish in time and was cancelled."""

    description: str
    timeout: float
    message = "Spark job {description!r} did not finish within {timeout:.0f}s and was cancelled"


def spark_conf(settings: Settings) -> dict[str, str]:
    return {
        "spark.app.name": "vchan_assets",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(settings.spark_partitions),
        "spark.default.parallelism": str(settings.spark_partitions),
        "spark.python.worker.reuse": "true",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.memory": os.environ.get("VCHAN_SPARK_DRIVER_MEMORY", "2g"),
        # The sync's tasks are long Python functions: don't speculate or retry them blindly.
        "spark.task.maxFailures": "1",
    }


def cluster_conf(settings: Settings) -> dict[str, str]:
    """Extra settings when the master is a cluster (the driver runs no tasks itself)."""
    if settings.spark_master.startswith("local"):
        return {}
    conf = {
        # A sync job is a few long tasks: let every executor register before the first job,
        # or they all queue on the first executor that did.
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "30s",
    }
    # Failpoints (crash tests) reach the tasks' Python workers on the executors.
    for name in (FAILPOINT_ENV, FAILPOINT_MARKER_ENV):
        if os.environ.get(name):
            conf[f"spark.executorEnv.{name}"] = os.environ[name]
    return conf


def get_spark(settings: Settings) -> SparkSession:
    """The process's SparkSession (created on first use)."""
    # Python workers must run this interpreter (the venv that has vchan_assets), not `python3`.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder
    if settings.spark_remote:
        builder = builder.remote(settings.spark_remote)
    else:
        builder = builder.master(settings.spark_master)
        for key, value in {**spark_conf(settings), **cluster_conf(settings)}.items():
            builder = builder.config(key, value)
    spark = _get_or_create(builder)
    if not settings.spark_remote:
        spark.sparkContext.setLogLevel("WARN")
    return spark


def _get_or_create(builder: SparkSession.Builder, attempts: int = 3) -> SparkSession:
    """PySpark forks the JVM with a preexec_fn; in a process with other threads (gRPC's)
    that child occasionally dies before exec ("Java gateway process exited before sending
    its port number"). Such a start is retried; other errors are not."""
    for attempt in range(1, attempts + 1):
        try:
            return builder.getOrCreate()
        except PySparkRuntimeError as exc:
            if "JAVA_GATEWAY_EXITED" not in str(exc) or attempt == attempts:
                raise
            log.warning("Spark's JVM exited at start (attempt %d of %d); retrying", attempt, attempts)
            time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")


class SparkUnavailableError(DeclaredError, RuntimeError):
    """This process's Spark session does not answer (its JVM died, or hangs)."""

    reason: str
    message = "the Spark session does not answer: {reason}"


def probe_spark(spark: SparkSession, timeout: float) -> None:
    """Whether the session's JVM answers within `timeout` seconds: a call into the driver's
    JVM (a classic session: no job, so executors busy with a sync do not delay it; Spark
    Connect: a one-row job). SparkUnavailableError if not."""
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            if settings_is_connect(spark):
                spark.range(1).count()
            elif spark.sparkContext._jsc is None or spark.sparkContext._jsc.sc().isStopped():
                outcome["error"] = "its SparkContext is stopped"
        except Exception as exc:  # py4j's errors of a dead gateway are many kinds
            outcome["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        outcome.setdefault("error", None)

    thread = threading.Thread(target=call, name="spark probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" not in outcome:
        raise SparkUnavailableError(f"no answer within {timeout:g}s")
    if outcome["error"] is not None:
        raise SparkUnavailableError(str(outcome["error"]))


def reset_spark() -> None:
    """Forget this process's classic Spark session, whose JVM died or hangs, so that the next
    `get_spark` launches a new JVM: PySpark keeps the gateway of the dead one in class
    attributes and would use it again. The old JVM, if still there, is killed."""
    from pyspark import SparkContext
    from pyspark.sql import SQLContext

    with SparkContext._lock:  # no session is created on the old gateway meanwhile
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "Unable to cleanly shutdown Spark JVM"
            sc = SparkContext._active_spark_context
            if sc is not None:
                try:
                    sc.stop()
                except Exception as exc:  # its JVM is gone: nothing to stop cleanly
                    log.warning("stopping the dead SparkContext: %s", exc)
        gateway = SparkContext._gateway
        if gateway is not None:
            proc = getattr(gateway, "proc", None)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
            try:
                gateway.shutdown(raise_exception=False)
            except Exception as exc:  # py4j may still fail closing sockets of a dead peer
                log.warning("closing the dead Spark gateway: %s", exc)
        SparkContext._gateway = None
        SparkContext._jvm = None
        SparkContext._active_spark_context = None
        SparkSession._instantiatedSession = None
        SparkSession._activeSession = None
        SQLContext._instantiatedContext = None


def run_job(spark: SparkSession, description: str, job: Callable[[], T], timeout: float) -> T:
    """Run a Spark action with a deadline: on timeout the job is cancelled and
    SparkJobTimeoutError raised (a hung Python worker must not hang the sync)."""
    group = f"vchan-{uuid.uuid4().hex[:8]}"
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            if settings_is_connect(spark):
                spark.addTag(group)
            else:
                spark.sparkContext.setJobGroup(group, description, interruptOnCancel=True)
            outcome["value"] = job()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"spark-job-{group}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.error("Spark job %r exceeded %.0fs; cancelling", description, timeout)
        if settings_is_connect(spark):
            spark.interruptTag(group)
        else:
            spark.sparkContext.cancelJobGroup(group)
        thread.join(30)
        raise SparkJobTimeoutError(description, timeout)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def run_arrow_tasks(
    spark: SparkSession,
    run: Callable[[list[S], Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
    specs: list[S],
    schema: pa.Schema,
    description: str,
    timeout: float,
) -> list[Any]:
    """One Spark job of `len(specs)` tasks through mapInArrow, one Spark partition each:
    `run(specs, batches)` gets batches holding its task indices and yields result rows
    of `schema`. Returns the collected rows; `run_job`'s deadline applies. Works on
    classic and Spark Connect sessions."""
    from pyspark.sql.pandas.types import from_arrow_schema

    def body(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return run(specs, batches)

    df = spark.range(len(specs), numPartitions=len(specs)).mapInArrow(body, from_arrow_schema(schema))
    return run_job(spark, description, df.collect, timeout)


def session_cores(spark: SparkSession) -> int:
    """How many tasks the session runs at once: its default parallelism (every executor
    core; the machine's cores for `local[*]`). A Spark Connect session, which has no
    SparkContext, says it through its `spark.default.parallelism` or a `local[N]` master;
    otherwise this machine's cores (a local Spark Connect server's)."""
    if not settings_is_connect(spark):
        return max(1, int(spark.sparkContext.defaultParallelism))
    declared = spark.conf.get("spark.default.parallelism", None)
    if declared:
        return max(1, int(declared))
    master = spark.conf.get("spark.master", None) or ""
    inside = master.removeprefix("local[").removesuffix("]")
    if master.startswith("local[") and inside.isdigit():
        return max(1, int(inside))
    return os.cpu_count() or 1


def settings_is_connect(spark: SparkSession) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")
