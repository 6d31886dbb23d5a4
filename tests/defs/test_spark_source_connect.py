"""`format("vchan")` through a Spark Connect server (the one `vchan up` runs): the data
source travels to the server's Python workers and reads what the pandas reader reads."""

from __future__ import annotations

import numpy as np

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.spark.session import get_spark
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows


def test_the_vchan_source_reads_through_spark_connect(
    dsettings: Settings, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    producer.insert(collection.name, generate_rows(collection.schema, 300, start_pk=0, seed=5))
    producer.delete(collection.name, list(range(0, 300, 7)))
    producer.flush(collection.name)
    storage = Storage.from_settings(dsettings)
    ids = IdAllocator(store)
    for vchannel in collection.vchannels:
        lease = grant_channel_lease(store, ids, vchannel, node_id=1)
        SyncTask(System(dsettings, store, storage), collection, vchannel, lease, engine="local").run()

    catalog = Catalog(System(dsettings, store, storage))
    remote = get_spark(dsettings)
    assert type(remote).__module__.startswith("pyspark.sql.connect")
    got = catalog.spark_collection(collection.name).toPandas().sort_values("pk")
    expected = catalog.read_collection(collection.name).sort_values("pk")
    assert list(got["pk"]) == list(expected["pk"]) == [pk for pk in range(300) if pk % 7]
    vector = next(f.name for f in collection.schema.fields if f.is_vector)
    as_bytes = [np.asarray(v, dtype="<f4").tobytes() for v in got[vector]]
    assert as_bytes == list(expected[vector])
