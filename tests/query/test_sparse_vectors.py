"""Sparse float vectors end to end: inserted as {index: value} dicts, synced, sorted and
read back as written (pandas: dicts; Spark: maps), indexed with SPARSE_INVERTED_INDEX
and searched by inner product, with and without a filter, against a scipy reference.
Real etcd, real files, a real local Spark."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp

from vchan_assets import fields, imports
from vchan_assets.catalog import Catalog
from vchan_assets.imports.jobs import ImportState
from vchan_assets.indexes.meta import InvalidIndexError, create_index
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentLevel, SegmentState
from vchan_assets.query.index_checks import check_recall, vchannel_indexes
from vchan_assets.query.search_options import SearchError
from vchan_assets.query.spark_source import spark_session
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.steps import compact_all, new_collection, sync_all
from vchan_assets.wal.producer import Producer

SCHEMA = CollectionSchema.build("pk", {"sv": "sparse_float_vector"}, {"n": "int64"})
VOCABULARY = 2_000


def rows(n: int, seed: int = 5) -> sp.csr_array:
    """n sparse rows of about 20 indices of a small vocabulary (rows share indices often)."""
    column = fields.random_sparse(np.random.default_rng(seed), n, VOCABULARY, nonzeros=20)
    offsets, indices, values = fields.sparse_buffers(column)
    return sp.csr_array((values, indices, offsets), shape=(n, VOCABULARY))


def as_dicts(matrix: sp.csr_array) -> list[dict[int, float]]:
    out = []
    for r in range(matrix.shape[0]):
        start, end = matrix.indptr[r], matrix.indptr[r + 1]
        out.append(
            dict(zip(matrix.indices[start:end].tolist(), matrix.data[start:end].tolist(), strict=True))
        )
    return out


def insert(producer: Producer, system: System, matrix: sp.csr_array) -> CollectionInfo:
    info = new_collection(producer, schema=SCHEMA, prefix="sparse")
    n = matrix.shape[0]
    producer.insert(info.name, {"pk": np.arange(n), "sv": as_dicts(matrix), "n": np.arange(n)})
    producer.flush(info.name)
    sync_all(system, info)
    return info


def reference(matrix: sp.csr_array, queries: sp.csr_array, k: int, allowed: np.ndarray | None = None) -> list:
    """The k best (pk, score) per query by scipy alone: rows sharing no index are no hits."""
    scores = (queries @ matrix.T).toarray()
    out = []
    for q in range(scores.shape[0]):
        candidates = np.flatnonzero((scores[q] != 0) & (True if allowed is None else allowed))
        best = candidates[np.lexsort((candidates, -scores[q][candidates]))][:k]
        out.append([(int(p), float(scores[q][p])) for p in best])
    return out


def found(hits, nq: int) -> list:
    return [
        [(int(r.pk), float(r.distance)) for r in hits[hits["query"] == q].itertuples()] for q in range(nq)
    ]


def assert_same(got: list, want: list) -> None:
    assert [[pk for pk, _ in q] for q in got] == [[pk for pk, _ in q] for q in want]
    for g, w in zip(got, want, strict=True):
        assert np.allclose([s for _, s in g], [s for _, s in w], rtol=1e-5)


def test_sparse_rows_read_back_as_written_by_pandas_and_spark_and_batch_searched(
    producer: Producer, system: System
) -> None:
    matrix = rows(1500)
    info = insert(producer, system, matrix)
    compact_all(system, info)
    frame = Catalog(system).read_collection(info.name).sort_values("pk")
    wanted = as_dicts(matrix)
    assert [{int(k): v for k, v in d.items()} for d in frame["sv"]] == [
        {k: pytest.approx(v) for k, v in d.items()} for d in wanted
    ]
    live = [s for s in segments(system.store, info) if s.state is SegmentState.FLUSHED and s.num_rows]
    segment = live[0]
    one = Catalog(system).read_segment(segment.id).iloc[0]
    assert one["sv"] == pytest.approx(wanted[int(one["pk"])])
    spark = spark_session(system)
    by_pk = {r["pk"]: r["sv"] for r in Catalog(system).spark_collection(info.name, fields="sv").collect()}
    assert by_pk[7] == pytest.approx(wanted[7])
    queries = rows(3, seed=17)
    frame = spark.createDataFrame(
        [(q, v) for q, v in enumerate(as_dicts(queries))], "query long, vector map<bigint, float>"
    )
    batch = Catalog(system).search_dataframe(info.name, frame, k=4).toPandas()
    assert_same(found(batch, 3), reference(matrix, queries, 4))  # Spark batch search: the same hits


def test_exact_search_scores_the_inner_product_over_shared_indices(
    producer: Producer, system: System
) -> None:
    matrix = rows(800)
    info = insert(producer, system, matrix[:600])
    tail = as_dicts(matrix[600:])  # in the log only: searched from the log's tail
    producer.insert(info.name, {"pk": np.arange(600, 800), "sv": tail, "n": np.arange(600, 800)})
    queries = rows(4, seed=9)
    hits = Catalog(system).search(info.name, as_dicts(queries), k=5)
    assert_same(found(hits, 4), reference(matrix, queries, 5))


def test_sparse_inverted_index_returns_what_exact_search_does(producer: Producer, system: System) -> None:
    matrix = rows(5000)  # segments of over MIN_ROWS_TO_BUILD rows: smaller ones get no index
    info = insert(producer, system, matrix)
    compact_all(system, info)
    create_index(system.store, info, "sv", "SPARSE_INVERTED_INDEX", "IP")
    report = IndexBuilder(system, "local").run(collection_id=info.id)
    assert report.finished and not report.failed
    assert any(
        s.state is SegmentState.FLUSHED and s.level is SegmentLevel.L1 for s in segments(system.store, info)
    )
    queries = rows(6, seed=11)
    catalog = Catalog(system)
    hits = catalog.search(info.name, as_dicts(queries), k=10)
    assert not hits.attrs["exact_segments"]  # through the index
    assert_same(found(hits, 6), reference(matrix, queries, 10))
    filtered = catalog.search(info.name, as_dicts(queries), k=10, filter="n % 3 == 0")
    assert_same(found(filtered, 6), reference(matrix, queries, 10, np.arange(5000) % 3 == 0))
    for vchannel in info.vchannels:
        outcome = check_recall(system.storage, vchannel_indexes(system.store, info, vchannel), floor=0.99)
        assert outcome.passed and outcome.metadata["recall_min"] == 1.0, outcome


def test_drop_ratios_are_taken_and_the_search_stays_near(producer: Producer, system: System) -> None:
    matrix = rows(3000)
    info = insert(producer, system, matrix)
    compact_all(system, info)
    create_index(system.store, info, "sv", "SPARSE_INVERTED_INDEX", "IP", {"drop_ratio_build": 0.2})
    assert IndexBuilder(system, "local").run(collection_id=info.id).finished
    queries = rows(5, seed=13)
    hits = Catalog(system).search(info.name, as_dicts(queries), k=10, params={"drop_ratio_search": 0.1})
    want = reference(matrix, queries, 10)
    overlap = [
        len({p for p, _ in g} & {p for p, _ in w}) / 10 for g, w in zip(found(hits, 5), want, strict=True)
    ]
    assert np.mean(overlap) >= 0.6


def test_sparse_field_takes_only_sparse_indexes_with_metric_ip(producer: Producer, system: System) -> None:
    info = new_collection(producer, schema=SCHEMA, prefix="sparse")
    with pytest.raises(InvalidIndexError, match="metric IP only"):
        create_index(system.store, info, "sv", "SPARSE_INVERTED_INDEX", "L2")
    with pytest.raises(InvalidIndexError, match="takes SPARSE_INVERTED_INDEX, SPARSE_WAND, not HNSW"):
        create_index(system.store, info, "sv", "HNSW", "IP")
    with pytest.raises(InvalidIndexError, match=r"drop_ratio_build=1.0 is out of range \[0, 1\)"):
        create_index(system.store, info, "sv", "SPARSE_WAND", "IP", {"drop_ratio_build": 1.0})


def test_bad_sparse_rows_are_refused_naming_field_and_row(producer: Producer, system: System) -> None:
    info = new_collection(producer, schema=SCHEMA, prefix="sparse")
    cases = {
        "strictly increasing": [{1: 0.5}, ([4, 2], [0.1, 0.2])],
        "outside": [{1: 0.5}, {-3: 0.1}],
        "NaN or infinite": [{1: 0.5}, {2: float("inf")}],
    }
    for reason, given in cases.items():
        with pytest.raises(ValueError, match=rf"field 'sv': .*{reason}.*\(row 1\)"):
            producer.insert(info.name, {"pk": [1, 2], "sv": given, "n": [1, 2]})
    producer.insert(
        info.name, {"pk": [1, 2], "sv": [{}, {9: 1.0, 3: 2.0}], "n": [1, 2]}
    )  # empty, unsorted dict
    with pytest.raises(SearchError, match="IP only"):
        Catalog(system).search(info.name, [{1: 1.0}], metric="L2")
    with pytest.raises(SearchError, match=r"strictly increasing .*\(query 0\)"):
        Catalog(system).search(info.name, [([3, 3], [1.0, 1.0])])


def test_an_import_of_maps_reads_back_and_a_bad_row_fails_the_job_naming_it(
    producer: Producer, system: System, tmp_path: Path
) -> None:
    info = new_collection(producer, schema=SCHEMA, prefix="sparse")
    matrix = rows(300)
    good = tmp_path / "good.parquet"
    column = pa.array([list(d.items()) for d in as_dicts(matrix)], pa.map_(pa.int64(), pa.float32()))
    pq.write_table(pa.table({"pk": np.arange(300), "sv": column, "n": np.arange(300)}), good)
    job = imports.run(
        imports.submit(info.name, [str(good)], store=system.store, settings=system.settings),
        engine="local",
        store=system.store,
        settings=system.settings,
    )
    assert job.state is ImportState.COMPLETED, job.reason
    frame = Catalog(system).read_collection(info.name).sort_values("pk")
    assert frame["sv"].iloc[42] == pytest.approx(as_dicts(matrix)[42])
    bad = tmp_path / "bad.parquet"
    texts = ['{"3": 0.5}', '{"indices": [9, 4], "values": [1.0, 2.0]}']
    pq.write_table(pa.table({"pk": [1000, 1001], "sv": texts, "n": [1, 2]}), bad)
    job = imports.run(
        imports.submit(info.name, [str(bad)], store=system.store, settings=system.settings),
        engine="local",
        store=system.store,
        settings=system.settings,
    )
    assert job.state is ImportState.FAILED
    assert "bad.parquet" in job.reason and "'sv'" in job.reason and "has index 4 after 9" in job.reason
    assert "row 1" in job.reason
