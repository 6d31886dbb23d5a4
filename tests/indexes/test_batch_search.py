"""Batch search in Spark: a DataFrame of query vectors -> the k nearest rows of each, the
segments searched by Spark tasks (one per segment, or one per slice of the queries), with
the same hits as `Catalog.search`: deletes applied, the query view at T, the log tail."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.tasks import list_tasks
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.query.batch_search import search_table
from vchan_assets.query.search import IndexFallbackWarning, SearchError, exact_segments
from vchan_assets.query.search_options import SearchOptions
from vchan_assets.query.spark_source import spark_session
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.index_data import Data, clustered, insert, new_data, sorted_segments
from vchan_assets.wal.producer import Producer

K = 5
QUERIES = clustered(12, seed=4242)
IDS = np.arange(1000, 1000 + len(QUERIES))


@pytest.fixture
def data(system: System, producer: Producer) -> Data:
    """Three sorted segments with an HNSW index, some of their rows deleted, and rows only
    in the log tail."""
    data = new_data(producer)
    sorted_segments(system, producer, data, [1500, 1200, 1100])
    create_index(system.store, data.info, "vec", "HNSW", "L2")
    assert len(IndexBuilder(system, "local").run().finished) == 3
    deleted = [data.pks[i] for i in range(0, 3800, 97)]
    producer.delete(data.info.name, deleted)
    data.deleted |= set(deleted)
    insert(producer, data, 300, start_pk=80_000)  # in the log only
    return data


def queries_df(system: System) -> Any:
    spark = spark_session(system)
    return spark.createDataFrame(pd.DataFrame({"query": IDS, "vector": [v.tolist() for v in QUERIES]}))


def as_rows(frame: pd.DataFrame, id_column: str = "query") -> list[tuple[int, int]]:
    return sorted(zip(frame[id_column].tolist(), frame["pk"].tolist(), strict=True))


@pytest.mark.parametrize("by", ["segment", "query"])
def test_batch_search_returns_the_hits_of_catalog_search(system: System, data: Data, by: str) -> None:
    expected = Catalog(system).search(data.info.name, QUERIES, k=K, output_fields=["n"])
    expected["query"] = IDS[expected["query"].to_numpy()]

    found = (
        Catalog(system)
        .search_dataframe(data.info.name, queries_df(system), k=K, by=by, output_fields=["n"])
        .toPandas()
    )

    assert list(found.columns) == ["query", "pk", "distance", "n"]
    assert as_rows(found) == as_rows(expected)
    merged = found.merge(expected, on=["query", "pk"], suffixes=("", "_expected"))
    assert np.allclose(merged["distance"], merged["distance_expected"], rtol=1e-5, atol=1e-4)
    assert (merged["n"] == merged["n_expected"]).all()
    assert not set(found["pk"]) & data.deleted
    assert set(found["pk"]) & set(range(80_000, 80_300)), "rows only in the log tail are found"


def test_batch_search_at_a_time_before_a_delete_sees_the_deleted_row(
    system: System, producer: Producer, data: Data
) -> None:
    travel = System(replace(system.settings, time_travel=600.0), system.store, system.storage)
    victim = int(Catalog(travel).search(data.info.name, QUERIES[:1], k=1)["pk"][0])
    marker = {"pk": [92_000], "vec": [QUERIES[-1] + 100.0], "n": [0], "tag": ["x"]}
    before = max(a.timestamp for a in producer.insert(data.info.name, marker).values())
    producer.delete(data.info.name, [victim], partition="_default")

    then = search_table(travel, data.info, queries_df(travel), SearchOptions(k=1, as_of=before)).to_pandas()
    now = search_table(travel, data.info, queries_df(travel), SearchOptions(k=1)).to_pandas()

    assert then.loc[then["query"] == IDS[0], "pk"].tolist() == [victim]
    assert victim not in set(now["pk"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vector_column": "embedding"}, "the query DataFrame has no column 'embedding'"),
        ({"k": 0}, r"k must be an integer in \[1, 16384\], got 0"),
        ({"by": "partition"}, "by must be 'segment' or 'query', got 'partition'"),
    ],
)
def test_batch_requests_that_cannot_run_are_refused_naming_why(
    system: System, data: Data, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(SearchError, match=message):
        Catalog(system).search_dataframe(data.info.name, queries_df(system), **kwargs)


def test_a_corrupt_file_found_by_a_spark_task_is_reported_and_queued(system: System, data: Data) -> None:
    build = list_builds(system.store, data.info.id)[1].model
    system.storage.write_atomic(build.files[0], b"corrupt")

    with pytest.warns(IndexFallbackWarning, match=f"segment {build.segment_id}: index file"):
        found = search_table(system, data.info, queries_df(system), SearchOptions(k=K))

    assert [f["segment"] for f in exact_segments(found)] == [build.segment_id]
    assert [d.model.segment_id for d in list_tasks(system.store, "index")] == [build.segment_id]


def test_one_options_object_gives_the_same_hits_through_catalog_cli_and_batch(
    system: System, settings: Settings, data: Data
) -> None:
    options = SearchOptions(k=K, metric="l2", filter="n % 3 != 0", params={"ef": 32}, output_fields=["n"])
    catalog = Catalog(system)

    given = catalog.search(data.info.name, QUERIES[:1], options)
    from_keywords = catalog.search(
        data.info.name,
        QUERIES[:1],
        k=K,
        metric="l2",
        filter="n % 3 != 0",
        params={"ef": 32},
        output_fields=["n"],
    )
    batch = catalog.search_dataframe(data.info.name, queries_df(system), options).toPandas()
    vector = ",".join(repr(float(x)) for x in QUERIES[0])
    run = subprocess.run(
        [str(VCHAN), "search", "--collection", data.info.name, "--vector", vector, "-k", str(K), "--metric", "l2",
         "--filter", "n % 3 != 0", "--param", "ef=32", "--output-fields", "n", "--json"],
        env=cli_env(settings), capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert run.returncode == 0, run.stderr
    cli = pd.DataFrame([json.loads(line) for line in run.stdout.splitlines()])
    expected = as_rows(given)
    assert len(expected) == K and all(n % 3 for n in given["n"])
    assert as_rows(from_keywords) == expected
    assert as_rows(cli) == expected
    first = batch[batch["query"] == IDS[0]].assign(query=0)
    assert as_rows(first) == expected
    assert list(batch.columns) == ["query", "pk", "distance", "n"]


def test_cli_refuses_bad_options_naming_the_collection(settings: Settings, data: Data) -> None:
    run = subprocess.run(
        [str(VCHAN), "search", "--collection", data.info.name, "--random", "1", "-k", "0"],
        env=cli_env(settings), capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert run.returncode == 1
    assert f"cannot search {data.info.name!r}: k must be an integer in [1, 16384], got 0" in run.stderr
