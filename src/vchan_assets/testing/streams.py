"""A change stream (`readStream.format("vchan")`) into a Parquet sink, run to its end in
this process or as a child process that a test can kill mid-batch:

    python -m vchan_assets.testing.streams COLLECTION SINK CHECKPOINT [--every=S] [option=value ...]

The child takes its settings from its environment (`harness.cli_env`), failpoints too
(`stream_read` stops or kills a task between two log files of a micro-batch). With
`--every=S` it follows the collection (a micro-batch every S seconds) until killed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from pyspark.errors import StreamingQueryException

from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.query.spark_source import read_options, spark_session
from vchan_assets.storage import Storage
from vchan_assets.system import System

START_ATTEMPTS = 3


def sink_changes(
    spark: Any, options: Mapping[str, str], sink: str, checkpoint: str, every: float | None = None
) -> Any:
    """Stream the changes into Parquet at `sink` until what is there now is in it
    (`trigger(availableNow=True)`); the finished query (its `recentProgress`). With
    `every`, a micro-batch every `every` seconds until the query fails or is killed."""
    writer = (
        spark.readStream.format("vchan")
        .options(**options)
        .load()
        .writeStream.format("parquet")
        .option("checkpointLocation", checkpoint)
    )
    if every is None:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{int(every * 1000)} milliseconds")
    for attempt in range(1, START_ATTEMPTS + 1):
        query = writer.start(sink)
        try:
            query.awaitTermination()
            return query
        except StreamingQueryException as exc:
            # Spark gives a new Python planner worker a fixed 10 s to connect back; on a
            # machine at load 40 it may not, and the query fails. A restart from the
            # checkpoint is what the stream is made for: the sink still gets each change once.
            if attempt == START_ATTEMPTS or "failed to connect back" not in str(exc):
                raise
    raise AssertionError("unreachable")


def sink_rows(spark: Any, sink: str) -> pa.Table:
    """What the sink holds: the files its metadata log committed (Spark reads that log; a
    killed task's leftover files are not in it)."""
    return spark.read.parquet(sink).toArrow()


def stream_options(settings: Settings, store: MetaStore, collection: str, **extra: str) -> dict[str, str]:
    """Options of a stream of `collection` on `settings`' etcd and storage (its id: `test-{collection}`)."""
    return {
        **read_options(settings, store.endpoints),
        "collection": collection,
        "streamId": f"test-{collection}",
        **extra,
    }


def main(argv: list[str]) -> None:
    collection, sink, checkpoint, *extra = argv
    every = None
    if extra and extra[0].startswith("--every="):
        every = float(extra.pop(0).removeprefix("--every="))
    settings = Settings.from_env()
    store = MetaStore.connect(settings)
    spark = spark_session(System(settings, store, Storage.from_settings(settings)))
    options = stream_options(settings, store, collection, **dict(e.split("=", 1) for e in extra))
    sink_changes(spark, options, sink, checkpoint, every)


if __name__ == "__main__":
    main(sys.argv[1:])
