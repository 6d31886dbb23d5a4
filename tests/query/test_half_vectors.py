"""float16 and bfloat16 vectors: stored at two bytes a value (half a float32 vector's
binlog), read back as floats by pandas' readers and Spark, indexed and searched like float
vectors. Real etcd, real files, a real local Spark."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets import fields
from vchan_assets.catalog import Catalog
from vchan_assets.indexes.meta import create_index
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentLevel, SegmentState
from vchan_assets.query.spark_source import spark_session
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.steps import compact_all, new_collection, sync_all
from vchan_assets.wal.producer import Producer

DIM = 16
HALF = CollectionSchema.build(
    "pk", {"h": f"float16_vector({DIM})", "b": f"bfloat16_vector({DIM})"}, {"n": "int64"}
)
FULL = CollectionSchema.build("pk", {"h": DIM, "b": DIM}, {"n": "int64"})


def embeddings(n: int) -> np.ndarray:
    return np.random.default_rng(3).normal(size=(n, DIM)).astype(np.float32)


def insert(
    producer: Producer, system: System, schema: CollectionSchema, matrix: np.ndarray
) -> CollectionInfo:
    info = new_collection(producer, schema=schema, prefix="half")
    n = len(matrix)
    producer.insert(info.name, {"pk": np.arange(n), "h": matrix, "b": matrix, "n": np.arange(n)})
    producer.flush(info.name)
    sync_all(system, info)
    return info


def vector_bytes(system: System, info: CollectionInfo) -> int:
    group = info.schema.field("h").field_id
    return sum(
        b.size_bytes
        for s in segments(system.store, info)
        if s.level is SegmentLevel.L1
        for g in s.binlogs
        if g.group == group
        for b in g.logs
    )


def test_half_vectors_take_half_the_bytes_and_read_back_as_floats(producer: Producer, system: System) -> None:
    matrix = embeddings(2000)
    half, full = insert(producer, system, HALF, matrix), insert(producer, system, FULL, matrix)
    assert 0.45 < vector_bytes(system, half) / vector_bytes(system, full) < 0.6
    table = Catalog(system).read_collection(half.name, as_arrow=True)
    assert isinstance(table, pa.Table) and table.schema.field("h").type == pa.binary(DIM * 2)
    order = np.argsort(table["pk"].to_numpy())
    for name, tolerance in (("h", 2e-3), ("b", 1.6e-2)):
        got = fields.decode_vectors(HALF.field(name), table[name])[order]
        assert np.allclose(got, matrix, rtol=tolerance, atol=tolerance)
    spark_session(system)
    rows = Catalog(system).spark_collection(half.name, fields="h").collect()
    by_pk = {r["pk"]: r["h"] for r in rows}
    assert np.allclose(np.asarray(by_pk[7], dtype=np.float32), matrix[7], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("field", ["h", "b"])
def test_half_vectors_are_indexed_and_searched_like_float_vectors(
    producer: Producer, system: System, field: str
) -> None:
    matrix = embeddings(5000)  # segments of over MIN_ROWS_TO_BUILD rows: smaller ones get no index
    info = insert(producer, system, HALF, matrix)
    compact_all(system, info)  # sorted: what an index is built on
    create_index(system.store, info, field, "IVF_FLAT", "L2", {"nlist": 16})
    report = IndexBuilder(system, "local").run(collection_id=info.id)
    assert report.finished and not report.failed
    live = [
        s
        for s in segments(system.store, info)
        if s.state is SegmentState.FLUSHED and s.level is SegmentLevel.L1
    ]
    assert live
    wanted = [5, 77, 1500]
    hits = Catalog(system).search(info.name, matrix[wanted], k=1, field=field, params={"nprobe": 16})
    assert hits.sort_values("query")["pk"].tolist() == wanted
    assert not hits.attrs["exact_segments"]  # through the index
