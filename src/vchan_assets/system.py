"""The running system as one value, passed to every service that works on it.

A `System` is what a sync, an import, a compaction or a lifecycle step needs from the
world around it: the settings, the metastore, the storage and, when the caller has one,
the Spark session to run jobs on. It opens nothing: `Stack.open` (a `System` that also
owns the embedded etcd it started) is the one way to open the system.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Self

from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage


@dataclass(frozen=True)
class System:
    settings: Settings
    store: MetaStore
    storage: Storage
    # A session to run Spark jobs on (Dagster's pyspark resource gives one); None: the
    # process's own (`spark.session.get_spark`), started when a job first needs it.
    spark: Any = None

    def with_spark(self, spark: Any) -> Self:
        return replace(self, spark=spark)
