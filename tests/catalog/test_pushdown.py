"""Filters on the primary key and the partition pushed down to the segments: the catalog's
`where`/`pks` and Spark's `pushFilters` read only the segments whose stats logs may hold
a matching pk, and return exactly the rows a full read filtered afterwards returns."""

from __future__ import annotations

import re
from typing import Any

import pandas as pd
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.query.prune import FilterError, StatsCache, parse_where, prune
from vchan_assets.query.spark_source import (
    ReadOptionError,
    ReadRequest,
    SegmentsPartition,
    TailPartition,
    VchanDataSource,
    VchanReader,
    read_options,
    spark_session,
)
from vchan_assets.query.view import collection_views
from vchan_assets.wal.producer import generate_rows

from .helpers import SCHEMA, Known


def _served(catalog: Catalog, known: Known) -> list[Any]:
    return [s for v in collection_views(catalog.store, known.info) for s in v.readable]


def _filtered(catalog: Catalog, name: str, keep: Any) -> pd.DataFrame:
    full = catalog.read_collection(name, with_vectors=False)
    return full[keep(full)].sort_values(["partition_id", "pk"]).reset_index(drop=True)


def _matches(col: pd.Series, op: str, value: Any) -> pd.Series:
    if op == "in":
        return col.isin(value)
    if op == "between":
        return col.between(*value)
    return {">=": col >= value, "<": col < value, "<=": col <= value, ">": col > value}[op]


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(["partition_id", "pk"]).reset_index(drop=True)


def test_a_point_lookup_reads_only_the_segment_whose_stats_may_hold_the_pk(
    catalog: Catalog, known: Known
) -> None:
    served = _served(catalog, known)
    kept = prune(catalog.storage, served, parse_where(known.info, [("pk", "=", 300)]))
    assert len(served) == 4 and len(kept) == 1  # p1's range rules 2 out, a bloom filter the third
    rows = catalog.read_collection(known.info.name, where=[("pk", "=", 300)])
    assert rows["pk"].tolist() == [300] and rows["segment_id"].tolist() == [kept[0].id]
    assert prune(catalog.storage, served, parse_where(known.info, [("pk", "=", 5000)])) == []


WHERES = {
    "in": [("pk", "in", [3, 10, 45, 300, 1005, 1100, 99_999])],  # 3 re-inserted, 10 and 1005 deleted
    "range": [("pk", ">=", 590), ("pk", "<", 1003)],
    "between": [("pk", "between", (98, 103))],  # 100, 101 deleted in p1 only: kept in _default
    "partition": [("partition", "=", "p1"), ("pk", "<=", 1050)],
    "contradiction": [("pk", "<", 10), ("pk", ">", 20)],
}


@pytest.mark.parametrize("name", WHERES)
def test_where_returns_what_a_full_read_filtered_afterwards_returns(
    catalog: Catalog, known: Known, name: str
) -> None:
    where = WHERES[name]
    got = _sorted(catalog.read_collection(known.info.name, with_vectors=False, where=where))
    ids = dict(zip(known.info.partition_names, known.info.partitions, strict=True))

    def keep(df: pd.DataFrame) -> pd.Series:
        mask = pd.Series(True, index=df.index)
        for column, op, value in where:
            if column == "partition":
                mask &= df["partition_id"] == ids[value]
                continue
            mask &= _matches(df["pk"], op, value)
        return mask

    expected = _filtered(catalog, known.info.name, keep)
    pd.testing.assert_frame_equal(got, expected)
    assert (len(got) == 0) == (name == "contradiction")


def test_pks_finds_rows_only_in_the_log_tail_and_persisted_ones(catalog: Catalog, known: Known) -> None:
    producer_rows = generate_rows(SCHEMA, 3, start_pk=7000, seed=9)
    from vchan_assets.wal.producer import Producer

    Producer(catalog.system).insert(known.info.name, producer_rows)  # no sync: only in the log
    got = catalog.read_collection(known.info.name, pks=[7001, 300, 10], with_vectors=False)
    assert sorted(got["pk"]) == [300, 7001]


@pytest.mark.parametrize(
    ("where", "names"),
    [
        ([("title", "=", 3)], "only the primary key"),
        ([("pk", "~", 3)], "unknown operator"),
        ([("pk", "=", "3")], "not an integer"),
        ([("pk", "in", 3)], "list of primary keys"),
        ([("partition", "=", "nope")], "no partition"),
        ([("pk", "=")], "expected (column, op, value)"),
    ],
)
def test_a_filter_the_reader_cannot_apply_is_a_clear_error(
    catalog: Catalog, known: Known, where: list[Any], names: str
) -> None:
    with pytest.raises(FilterError, match=re.escape(names)):
        catalog.read_collection(known.info.name, where=where)


def test_the_spark_source_plans_only_the_segments_its_pk_options_keep(catalog: Catalog, known: Known) -> None:
    options = {
        **read_options(catalog.settings, catalog.store.endpoints),
        "collection": known.info.name,
        "pks": "300",
    }
    reader = VchanReader(options, VchanDataSource(options).schema())
    parts = reader.partitions()
    segments = [s for p in parts if isinstance(p, SegmentsPartition) for s in p.segments]
    assert len(segments) == 1 and not [p for p in parts if isinstance(p, TailPartition)]
    rows = [b for p in parts for b in reader.read(p)]
    assert sum(b.num_rows for b in rows) == 1


def test_a_spark_read_with_pk_options_returns_what_the_catalog_returns(
    catalog: Catalog, known: Known
) -> None:
    spark_session(catalog.system)
    for options, where in [
        ({"pks": "3,10,300,1100"}, [("pk", "in", [3, 10, 300, 1100])]),
        ({"pk_min": "590", "pk_max": "1002"}, [("pk", ">=", 590), ("pk", "<=", 1002)]),
    ]:
        df = catalog.spark_collection(known.info.name, with_vectors=False, **options)
        got = _sorted(df.toPandas())
        expected = _sorted(catalog.read_collection(known.info.name, with_vectors=False, where=where))
        assert got["pk"].tolist() == expected["pk"].tolist()
        assert df.count() == len(expected)


def test_a_wrong_pk_option_is_a_clear_error() -> None:
    with pytest.raises(ReadOptionError, match="option pk_min='1,2': expected one primary key"):
        ReadRequest.from_options({"collection": "c", "pk_min": "1,2"})
    # Text is a key of a VarChar pk: only a collection with an int64 pk refuses it.
    request = ReadRequest.from_options({"collection": "c", "pks": "a,b"})
    with pytest.raises(ReadOptionError, match="option pks='a,b': expected integer primary keys"):
        request.pushdown(CollectionInfo(1, "c", SCHEMA, (2,), ("v0",)))
    varchar = CollectionSchema.build("doc", {"vec": 4}, {}, pk_type="varchar(8)")
    assert request.pushdown(CollectionInfo(1, "c", varchar, (2,), ("v0",))).pk.values == ("a", "b")


def test_stats_logs_are_read_once_and_the_cache_is_bounded(catalog: Catalog, known: Known) -> None:
    cache = StatsCache(size=2)
    paths = [b.path for s in _served(catalog, known) for b in s.statslogs][:3]
    first = cache.get(catalog.storage, paths[0])
    assert cache.get(catalog.storage, paths[0]) is first  # not read again
    cache.get(catalog.storage, paths[1])
    cache.get(catalog.storage, paths[2])  # the oldest (paths[0]) goes
    assert cache.get(catalog.storage, paths[0]) is not first
