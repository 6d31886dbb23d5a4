"""`spark.read.format("vchan")` against `Catalog.read_collection` on the same data: real
etcd, real binlogs, a real local Spark (and a Spark Connect server)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.meta.store import MetaStore
from vchan_assets.query.source_options import ReadOptionError, ReadRequest, vectors_as_lists
from vchan_assets.query.spark_source import spark_session
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import SCHEMA, Known


@pytest.fixture
def spark(catalog: Catalog) -> object:
    """The process's session with format("vchan") registered."""
    return spark_session(catalog.system)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(["partition_id", "pk"]).reset_index(drop=True)


def _as_pandas_vectors(df: pd.DataFrame, column: str) -> pd.Series:
    """Spark's array<float> vectors as the float32 bytes the pandas reader returns."""
    return df[column].map(lambda v: np.asarray(v, dtype="<f4").tobytes())


def test_the_spark_source_returns_what_read_collection_returns(
    catalog: Catalog, known: Known, spark: object
) -> None:
    expected = _sorted(catalog.read_collection(known.info.name))
    got = _sorted(catalog.spark_collection(known.info.name).toPandas())
    assert set(got["pk"]) == known.visible  # deletes applied per partition, re-inserts kept
    assert list(got.columns) == list(expected.columns)
    got["vec"] = _as_pandas_vectors(got, "vec")
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)


def test_small_segments_share_tasks_each_segment_read_once(
    catalog: Catalog, known: Known, spark: object
) -> None:
    segments = catalog.segments(known.info.name)
    readable = segments[
        (segments["level"] != "L0") & (segments["state"] != "Dropped") & (segments["num_rows"] > 0)
    ]
    assert len(readable) == 4
    per_segment = catalog.spark_collection(known.info.name, task_mb="0")
    assert per_segment.rdd.getNumPartitions() == len(readable)
    one_core = {"VCHAN_SPARK_PARTITIONS": "1"}  # at least two tasks per core
    grouped = catalog.spark_collection(known.info.name, **one_core)
    assert grouped.rdd.getNumPartitions() == 2  # KB-sized segments: the fewest tasks allowed
    assert catalog.spark_collection(known.info.name, task_mb="0.001", **one_core).rdd.getNumPartitions() == 4
    expected = catalog.read_collection(known.info.name).groupby("segment_id").size()
    for df in (per_segment, grouped):
        counts = df.groupBy("segment_id").count().toPandas().set_index("segment_id")["count"]
        pd.testing.assert_series_equal(counts.sort_index(), expected, check_names=False, check_dtype=False)


def test_partition_and_field_options_prune_what_is_read(
    catalog: Catalog, known: Known, spark: object
) -> None:
    df = catalog.spark_collection(known.info.name, partition="p1", fields="n", vectors="binary")
    assert df.columns == ["row_id", "timestamp", "pk", "n", "segment_id", "partition_id"]
    rows = df.toPandas()
    assert set(rows["pk"]) == set(range(1000, 1200)) - set(known.deleted["p1"])
    binary = catalog.spark_collection(known.info.name, fields="vec", vectors="binary").toPandas()
    expected = catalog.read_collection(known.info.name).set_index("pk")["vec"]
    assert all(bytes(v) == expected[pk] for pk, v in zip(binary["pk"], binary["vec"], strict=True))
    no_vectors = catalog.spark_collection(known.info.name, with_vectors=False)
    assert "vec" not in no_vectors.columns


def test_bad_reads_fail_naming_the_collection_field_or_file(
    catalog: Catalog, known: Known, spark: object, settings: Settings, store: MetaStore
) -> None:
    with pytest.raises(LookupError, match="no_such_books"):
        catalog.spark_collection("no_such_books")
    with pytest.raises(Exception, match="no_such_books"):  # straight through Spark's planner
        spark.read.format("vchan").option("collection", "no_such_books").options(  # type: ignore[attr-defined]
            VCHAN_ETCD_ENDPOINTS=",".join(store.endpoints), VCHAN_ROOT=settings.root
        ).load()
    with pytest.raises(Exception, match="no field 'nope'"):
        catalog.spark_collection(known.info.name, fields="nope").collect()
    with pytest.raises(Exception, match="no partition"):
        catalog.spark_collection(known.info.name, partition="p9").collect()

    seg = next(s for s in catalog.segment_infos(known.info.id) if s.binlogs)
    lost = seg.binlogs[0].logs[0].path
    Path(catalog.storage.path(lost)).unlink()
    with pytest.raises(Exception, match=lost.rsplit("/", 1)[-1]):
        catalog.spark_collection(known.info.name, segments=str(seg.id)).collect()


def test_a_collection_dropped_between_load_and_action_is_named(
    catalog: Catalog, known: Known, spark: object, store: MetaStore
) -> None:
    df = catalog.spark_collection(known.info.name)  # loaded while it exists
    CollectionRegistry(store).drop(known.info.name)
    with pytest.raises(Exception, match=f"no collection with name '{known.info.name}'"):
        df.count()  # planned at the action: the collection is gone
    with pytest.raises(LookupError, match=known.info.name):
        catalog.spark_collection(known.info.name)
    with pytest.raises(LookupError, match=known.info.name):
        catalog.read_collection(known.info.name)  # pandas says the same


def test_read_options_are_checked() -> None:
    with pytest.raises(ReadOptionError, match="collection"):
        ReadRequest.from_options({})
    with pytest.raises(ReadOptionError, match="vectors"):
        ReadRequest.from_options({"collection": "c", "vectors": "list"})
    with pytest.raises(ReadOptionError, match="segments"):
        ReadRequest.from_options({"collection": "c", "segments": "7,x"})
    for bad in ("-1", "x", "nan"):
        with pytest.raises(ReadOptionError, match="task_mb"):
            ReadRequest.from_options({"collection": "c", "task_mb": bad})
    assert ReadRequest.from_options({"Collection": "c", "PARTITION": "a, b"}).partitions == ("a", "b")


def test_vectors_become_float_lists_without_copying_rows() -> None:
    floats = np.arange(12, dtype="<f4")
    binary = pa.array([floats[i * 4 : i * 4 + 4].tobytes() for i in range(3)], pa.binary(16))
    lists = vectors_as_lists(binary.slice(1), 4)
    assert lists.to_pylist() == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    with_null = pa.array([floats[:4].tobytes(), None], pa.binary(16))
    assert vectors_as_lists(with_null, 4).to_pylist() == [[0.0, 1.0, 2.0, 3.0], None]


def test_the_spark_source_reads_the_log_tail_and_reads_at_a_timestamp_like_read_collection(
    catalog: Catalog, known: Known, spark: object, settings: Settings, store: MetaStore
) -> None:
    producer = Producer(catalog.system)
    before = max(
        a.timestamp
        for a in producer.insert(known.info.name, generate_rows(SCHEMA, 5, start_pk=0, seed=3)).values()
    )
    # Not synced: new rows in both partitions, and deletes of persisted and of new rows.
    producer.insert(known.info.name, generate_rows(SCHEMA, 40, start_pk=5000, seed=9))
    producer.insert(known.info.name, generate_rows(SCHEMA, 10, start_pk=6000, seed=8), partition="p1")
    producer.delete(known.info.name, [60, 61, 5000, 5001], partition="_default")
    now = _sorted(catalog.read_collection(known.info.name))
    assert {5002, 6000, 0} <= set(now["pk"]) and not {60, 61, 5000} & set(now["pk"])
    got = _sorted(catalog.spark_collection(known.info.name).toPandas())
    got["vec"] = _as_pandas_vectors(got, "vec")
    pd.testing.assert_frame_equal(got, now, check_dtype=False)
    p1 = catalog.spark_collection(known.info.name, partition="p1", fields="n").toPandas()
    assert set(p1["pk"]) == set(now[now["partition_id"] == known.info.partitions[1]]["pk"])

    travel = Catalog(System(replace(settings, time_travel=600.0), store, catalog.storage))
    then = _sorted(travel.read_collection(known.info.name, as_of=before))
    assert set(then["pk"]) == known.visible
    at = _sorted(travel.spark_collection(known.info.name, as_of=str(before)).toPandas())
    at["vec"] = _as_pandas_vectors(at, "vec")
    pd.testing.assert_frame_equal(at, then, check_dtype=False)
    with pytest.raises(Exception, match="cannot read as of 'yesterday': not a timestamp"):
        catalog.spark_collection(known.info.name, as_of="yesterday").collect()
