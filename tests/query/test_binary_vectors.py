"""Binary vectors end to end: inserted and imported as packed bits, synced, compacted, read
back byte for byte by pandas and Spark, indexed with BIN_IVF_FLAT and searched by HAMMING
and JACCARD (through the index, exactly, filtered), with distances as a numpy count of bits
gives them. Real etcd, real files, a real local Spark."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.imports.jobs import ImportState
from vchan_assets.indexes.meta import InvalidIndexError, create_index
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.model import CollectionInfo, CollectionSchema, MetricType
from vchan_assets.query.index_checks import check_recall, vchannel_indexes
from vchan_assets.query.search_options import SearchError
from vchan_assets.query.spark_source import spark_session
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.import_files import run_import, write_parquet
from vchan_assets.testing.steps import compact_all, new_collection, sync_all
from vchan_assets.wal.producer import Producer

DIM = 128  # bits: 16 bytes a vector
SCHEMA = CollectionSchema.build("pk", {"bits": f"binary_vector({DIM})"}, {"n": "int64"})


def clustered(n: int, seed: int = 5) -> np.ndarray:
    """(n, DIM / 8) packed bits around 32 centres, about 6 of 128 bits flipped each."""
    rng = np.random.default_rng(seed)
    centres = rng.integers(0, 2, (32, DIM), dtype=np.uint8)
    flips = rng.random((n, DIM)) < 0.05
    return np.packbits(centres[rng.integers(0, 32, n)] ^ flips, axis=1)


def reference(queries: np.ndarray, base: np.ndarray, metric: MetricType) -> np.ndarray:
    """(nq, n) distances counted bit by bit."""
    a = np.unpackbits(queries, axis=1).astype(bool)[:, None, :]
    b = np.unpackbits(base, axis=1).astype(bool)[None, :, :]
    if metric is MetricType.HAMMING:
        return (a != b).sum(2).astype(np.float32)
    union = (a | b).sum(2)
    return np.where(union > 0, 1 - (a & b).sum(2) / np.maximum(union, 1), 0).astype(np.float32)


def inserted(producer: Producer, system: System, matrix: np.ndarray) -> CollectionInfo:
    info = new_collection(producer, schema=SCHEMA, prefix="bits")
    n = len(matrix)
    producer.insert(info.name, {"pk": np.arange(n), "bits": matrix, "n": np.arange(n)})
    producer.flush(info.name)
    sync_all(system, info)
    return info


def indexed(
    producer: Producer, system: System, matrix: np.ndarray, metric: MetricType | str, nlist: int = 16
) -> CollectionInfo:
    """`inserted`, sorted (what an index is built on), with a BIN_IVF_FLAT index built."""
    info = inserted(producer, system, matrix)
    compact_all(system, info)
    create_index(system.store, info, "bits", "BIN_IVF_FLAT", metric, {"nlist": nlist})
    report = IndexBuilder(system, "local").run(collection_id=info.id)
    assert report.finished and not report.failed
    return info


def by_pk(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("pk").reset_index(drop=True)


def test_binary_vectors_read_back_byte_for_byte_with_pandas_and_spark(
    producer: Producer, system: System
) -> None:
    matrix = clustered(3000)
    info = inserted(producer, system, matrix)
    catalog = Catalog(system)
    table = catalog.read_collection(info.name, as_arrow=True)
    assert isinstance(table, pa.Table) and table.schema.field("bits").type == pa.binary(DIM // 8)
    compact_all(system, info)  # sorted and merged: the bytes move, unchanged
    frame = by_pk(catalog.read_collection(info.name))
    assert frame["bits"].tolist() == [row.tobytes() for row in matrix]
    spark_session(system)
    rows = catalog.spark_collection(info.name).collect()
    assert {r["pk"]: bytes(r["bits"]) for r in rows} == {i: row.tobytes() for i, row in enumerate(matrix)}


@pytest.mark.parametrize("metric", [MetricType.HAMMING, MetricType.JACCARD])
def test_an_exact_search_reports_milvus_distances(
    producer: Producer, system: System, metric: MetricType
) -> None:
    matrix = clustered(1500)
    info = inserted(producer, system, matrix)  # no index: every segment searched exactly
    queries = clustered(4, seed=9)
    hits = Catalog(system).search(info.name, queries, k=5, metric=metric)
    want = reference(queries, matrix, metric)
    for q, group in hits.groupby("query"):
        kth = np.sort(want[q])[:5]
        assert np.allclose(group["distance"], kth, atol=1e-6)
        assert np.allclose(group["distance"], want[q][group["pk"]], atol=1e-6)


@pytest.mark.parametrize("metric", [MetricType.HAMMING, MetricType.JACCARD])
def test_bin_ivf_flat_finds_each_row_at_distance_0_through_the_index(
    producer: Producer, system: System, metric: MetricType
) -> None:
    matrix = clustered(5000)  # segments of over MIN_ROWS_TO_BUILD rows: smaller ones get no index
    info = indexed(producer, system, matrix, metric)
    catalog = Catalog(system)
    wanted = [5, 77, 1500, 4999]
    hits = catalog.search(info.name, matrix[wanted], k=3, params={"nprobe": 16})
    assert not hits.attrs["exact_segments"]  # through the index
    first = hits.sort_values(["query", "distance"]).groupby("query").head(1)
    assert first["pk"].tolist() == wanted and (first["distance"] == 0).all()
    # nprobe = nlist: every list probed, the same distances as exact search
    want = np.sort(reference(matrix[wanted], matrix, metric), axis=1)[:, :3]
    assert np.allclose(hits.sort_values(["query", "distance"])["distance"].to_numpy().reshape(4, 3), want)


def test_a_filtered_search_through_bin_ivf_flat_keeps_only_the_rows_the_filter_keeps(
    producer: Producer, system: System
) -> None:
    matrix = clustered(5000)
    info = indexed(producer, system, matrix, "HAMMING")
    wanted = [10, 11, 12]
    hits = Catalog(system).search(
        info.name, matrix[wanted], k=4, filter="n % 2 == 0", params={"nprobe": 16}, output_fields=["n"]
    )
    assert not hits.attrs["exact_segments"] and (hits["n"] % 2 == 0).all() and len(hits) == 12
    even = np.arange(0, 5000, 2)
    want = np.sort(reference(matrix[wanted], matrix[even], MetricType.HAMMING), axis=1)[:, :4]
    assert np.allclose(hits.sort_values(["query", "distance"])["distance"].to_numpy().reshape(3, 4), want)
    assert hits[hits["query"] == 0]["pk"].iloc[0] == 10  # its own row, kept by the filter


def test_a_batch_search_in_spark_takes_binary_queries_as_bytes(producer: Producer, system: System) -> None:
    matrix = clustered(4000)  # two segments of 2,000: both indexed
    info = indexed(producer, system, matrix, "HAMMING", nlist=8)
    wanted = [4, 900, 3999]
    queries = spark_session(system).createDataFrame(
        pd.DataFrame({"query": [40, 41, 42], "vector": [matrix[i].tobytes() for i in wanted]})
    )
    catalog = Catalog(system)
    batch = catalog.search_dataframe(info.name, queries, k=2, params={"nprobe": 8}).toPandas()
    alone = catalog.search(info.name, matrix[wanted], k=2, params={"nprobe": 8})
    first = batch.sort_values(["query", "distance"]).groupby("query").head(1)
    assert first["pk"].tolist() == wanted and (first["distance"] == 0).all()
    assert sorted(batch["distance"]) == sorted(alone["distance"])


def test_the_index_recall_check_judges_binary_indexes(producer: Producer, system: System) -> None:
    info = indexed(producer, system, clustered(5000), "JACCARD")
    outcomes = [
        check_recall(system.storage, vchannel_indexes(system.store, info, v), 0.9) for v in info.vchannels
    ]
    assert sum(int(o.metadata["indexes_checked"]) for o in outcomes) >= 1
    assert all(o.passed for o in outcomes), [o.description for o in outcomes]


def test_float_metrics_and_index_types_are_refused_on_binary_vectors(
    producer: Producer, system: System
) -> None:
    info = inserted(producer, system, clustered(100))
    with pytest.raises(InvalidIndexError, match="metric L2 is not for the binary vector field 'bits'"):
        create_index(system.store, info, "bits", "BIN_IVF_FLAT", "L2")
    with pytest.raises(InvalidIndexError, match="index type HNSW is not for the binary vector field 'bits'"):
        create_index(system.store, info, "bits", "HNSW", "HAMMING")
    catalog = Catalog(system)
    with pytest.raises(SearchError, match="metric COSINE is not for the binary vector field"):
        catalog.search(info.name, clustered(1), metric="COSINE")
    with pytest.raises(SearchError, match=r"got float32 of shape \(1, 16\)"):
        catalog.search(info.name, np.zeros((1, 16), dtype=np.float32))


def test_binary_metrics_are_refused_on_float_vectors(producer: Producer, system: System) -> None:
    schema = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64"})
    info = new_collection(producer, schema=schema, prefix="floats")
    with pytest.raises(InvalidIndexError, match="metric HAMMING is not for the float vector field 'vec'"):
        create_index(system.store, info, "vec", "IVF_FLAT", "HAMMING")
    with pytest.raises(InvalidIndexError, match="index type BIN_IVF_FLAT is not for the float vector field"):
        create_index(system.store, info, "vec", "BIN_IVF_FLAT", "L2")
    with pytest.raises(SearchError, match="metric JACCARD is not for the float vector field 'vec'"):
        Catalog(system).search(info.name, np.zeros((1, 8), dtype=np.float32), metric="JACCARD")


def test_an_import_takes_binary_vectors_as_bytes_or_byte_lists(
    producer: Producer, system: System, tmp_path: Path
) -> None:
    matrix = clustered(40)
    info = new_collection(producer, schema=SCHEMA, prefix="bits")
    as_bytes = pa.table({"pk": np.arange(20), "bits": [r.tobytes() for r in matrix[:20]], "n": np.arange(20)})
    as_lists = pa.table(
        {"pk": np.arange(20, 40), "bits": [r.tolist() for r in matrix[20:]], "n": np.arange(20, 40)}
    )
    paths = [write_parquet(tmp_path / "a.parquet", as_bytes), write_parquet(tmp_path / "b.parquet", as_lists)]
    job = run_import(system.store, system.settings, info, paths)
    assert job.state is ImportState.COMPLETED, job.reason
    frame = by_pk(Catalog(system).read_collection(info.name))
    assert frame["bits"].tolist() == [row.tobytes() for row in matrix]


@pytest.mark.parametrize(
    ("column", "says"),
    [
        ([b"\0" * 16, b"\0" * 15], r"column 'bits': has 15 bytes at row 1, expected 16 \(dim 128 bits\)"),
        ([[0] * 16, [0] * 17], r"column 'bits': has 17 bytes at row 1, expected 16"),
        (
            [[0] * 16, [0] * 15 + [256]],
            r"column 'bits': holds 256 at row 1: a byte is an integer in \[0, 255\]",
        ),
        ([[0.5] * 16, [0.5] * 16], r"column 'bits': is list<\w+: double>, expected a binary vector's bytes"),
    ],
)
def test_an_import_refuses_bad_binary_vectors_naming_file_column_and_row(
    producer: Producer, system: System, tmp_path: Path, column: list[object], says: str
) -> None:
    info = new_collection(producer, schema=SCHEMA, prefix="bits")
    path = write_parquet(tmp_path / "bad.parquet", pa.table({"pk": [0, 1], "bits": column, "n": [0, 1]}))
    job = run_import(system.store, system.settings, info, [path])
    assert job.state is ImportState.FAILED and "bad.parquet" in job.reason
    assert pd.Series([job.reason]).str.contains(says).all(), job.reason


def test_the_cli_makes_indexes_and_searches_a_binary_vector_collection(system: System) -> None:
    name = f"bits{uuid.uuid4().hex[:8]}"

    def vchan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VCHAN), *args], env=cli_env(system.settings), capture_output=True, text=True, timeout=120
        )

    def hits(*args: str) -> list[dict[str, float]]:
        done = vchan("search", "--collection", name, "--json", *args)
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]

    made = vchan(
        "create-collection",
        "--collection",
        name,
        "--vector-type",
        "binary",
        "--dim",
        "64",
        "--scalars",
        "n:int64",
    )
    assert made.returncode == 0, made.stderr
    assert vchan("produce", "--collection", name, "--rows", "200", "--flush").returncode == 0
    index = vchan("create-index", "--collection", name, "--field", "vector", "--type", "BIN_FLAT")  # HAMMING
    assert "BIN_FLAT, HAMMING" in index.stdout, index.stderr
    found = hits("--random", "2", "-k", "3")
    assert len(found) == 6 and all(h["distance"] == int(h["distance"]) for h in found)  # bits that differ
    zeros = hits("--vector", "0,0,0,0,0,0,0,0", "-k", "1")
    assert 10 < zeros[0]["distance"] < 54  # the fewest bits set of 200 random 64-bit vectors
    bad = vchan("search", "--collection", name, "--vector", "0,0,0,0,0,0,0,256")
    assert bad.returncode != 0 and "integers in [0, 255]" in bad.stderr
