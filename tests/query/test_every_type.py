"""One collection with every type Milvus' data model has here, a partition key, a TTL and
the dynamic field, through every path: produced into, deleted from, synced, sorted and
compacted, imported into, read with pandas, Spark and the change stream, indexed and
searched. Real etcd, real files, a real local Spark. Each type's own rules have their own
tests (test_scalar_types, test_varchar_pk, test_half_vectors, test_partition_key,
lifecycle/test_ttl, test_binary_vectors, test_sparse_vectors); this one is that they hold together."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp

from vchan_assets import fields
from vchan_assets.catalog import Catalog
from vchan_assets.imports.jobs import ImportState
from vchan_assets.indexes.meta import create_index
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.model import DYNAMIC_FIELD, CollectionInfo, CollectionSchema, SegmentLevel
from vchan_assets.query.spark_source import spark_session
from vchan_assets.query.stream_source import VchanStreamReader
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.import_files import run_import, write_parquet
from vchan_assets.testing.steps import compact_all, sync_all
from vchan_assets.testing.streams import stream_options
from vchan_assets.wal.producer import Producer, generate_rows

DIM = 8
EVERY = CollectionSchema.build(
    "doc",
    {
        "f32": DIM,
        "f16": f"float16_vector({DIM})",
        "bf16": f"bfloat16_vector({DIM})",
        "fp": "binary_vector(64)",
        "sp": "sparse_float_vector",
    },
    {
        "tenant": "varchar(12)",
        "i8": "int8",
        "i16": "int16",
        "i32": "int32",
        "i64": "int64?",
        "f": "float=0.5",
        "d": "double",
        "b": "bool",
        "s": "varchar(32)",
        "j": "json?",
        "a": "array(int32, 4)",
        "tags": "array(varchar(8), 3)",
    },
    pk_type="varchar(36)",
    dynamic=True,
    partition_key="tenant",
)
# Index type and metric per dense vector field (each row's own vector is its nearest).
INDEXES = {
    "f32": ("IVF_FLAT", "L2", {"nlist": 8}),
    "f16": ("HNSW", "L2", {}),
    "bf16": ("IVF_FLAT", "COSINE", {"nlist": 8}),
    "fp": ("BIN_IVF_FLAT", "HAMMING", {"nlist": 8}),
}


def every_rows(n: int, seed: int) -> pa.Table:
    """`n` rows of EVERY with UUID keys, 6 tenants, and a `color` the schema lacks (it goes to
    the dynamic field)."""
    rng = np.random.default_rng(seed)
    table = generate_rows(EVERY, n, seed=seed)
    keys = [str(uuid.UUID(int=int(rng.integers(0, 2**62)) << 64 | i)) for i in range(n)]
    table = table.set_column(0, "doc", pa.array(keys))
    tenant = table.schema.get_field_index("tenant")
    table = table.set_column(tenant, "tenant", pa.array([f"t{i % 6}" for i in range(n)]))
    return table.append_column("color", pa.array(["red", "blue", None][i % 3] for i in range(n)))


def test_a_collection_of_every_type_is_produced_synced_compacted_imported_read_streamed_indexed_and_searched(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    info = producer.create_collection(
        f"every{uuid.uuid4().hex[:6]}", EVERY, num_channels=1, num_partitions=2, ttl_seconds=3600
    )
    inserted = every_rows(3000, seed=1)
    producer.insert(info.name, inserted)
    deleted = inserted["doc"].to_pylist()[::100]
    producer.delete(info.name, deleted)
    producer.flush(info.name)
    sync_all(system, info)
    compact_all(system, info)
    imported = every_rows(400, seed=2)
    job = run_import(
        system.store, system.settings, info, [write_parquet(tmp_path / "more.parquet", imported)]
    )
    assert job.state is ImportState.COMPLETED, job.reason

    # pandas: every live row once, each value as written (vectors at their own width).
    rows = pa.concat_tables([inserted, imported])
    live = set(rows["doc"].to_pylist()) - set(deleted)
    table = Catalog(system).read_collection(info.name, as_arrow=True)
    assert isinstance(table, pa.Table)
    assert table.num_rows == len(live) == 3370 and set(table["doc"].to_pylist()) == live
    _assert_values(info, table, rows)
    assert len({s.partition_id for s in segments(system.store, info) if s.level is SegmentLevel.L1}) == 2

    # Spark and the change stream see the same rows and deletes.
    spark_session(system)
    assert Catalog(system).spark_collection(info.name, with_vectors=False).count() == len(live)
    reader = VchanStreamReader(stream_options(system.settings, system.store, info.name, fields="tenant,j"))
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    changes = pa.Table.from_batches([b for p in reader.partitions(start, end) for b in reader.read(p)])
    inserts = changes.filter(pc.equal(changes["op"], "insert"))
    assert sorted(inserts["doc"].to_pylist()) == sorted(inserted["doc"].to_pylist())  # the log's rows
    assert changes.filter(pc.equal(changes["op"], "delete")).num_rows == len(deleted) * len(info.partitions)

    # Each vector field indexed, and searched through its index for rows' own vectors.
    for name, (kind, metric, params) in INDEXES.items():
        create_index(system.store, info, name, kind, metric, params)
    report = IndexBuilder(system, "local").run(collection_id=info.id)
    assert report.finished and not report.failed
    by_doc = {doc: i for i, doc in enumerate(rows["doc"].to_pylist())}
    wanted = sorted(live)[:3]
    for name in INDEXES:
        queries = fields.vector_matrix(EVERY.field(name), rows[name].take([by_doc[d] for d in wanted]))
        hits = Catalog(system).search(info.name, queries, k=1, field=name, output_fields=["tenant", "j"])
        assert hits.sort_values("query")["doc"].tolist() == wanted, name
    # The sparse field through its inverted index: the best inner product over the live rows.
    create_index(system.store, info, "sp", "SPARSE_INVERTED_INDEX", "IP")
    assert not IndexBuilder(system, "local").run(collection_id=info.id).failed
    query = rows["sp"].take([by_doc[wanted[0]]])
    offsets, indices, values = fields.sparse_buffers(table["sp"])
    width = int(max(indices.max(), fields.sparse_buffers(query)[1].max())) + 1
    matrix = sp.csr_array((values, indices, offsets), shape=(table.num_rows, width))
    q_offsets, q_indices, q_values = fields.sparse_buffers(query)
    scores = matrix @ sp.csr_array((q_values, q_indices, q_offsets), shape=(1, width)).T
    best = table["doc"][int(np.argmax(scores.toarray().ravel()))].as_py()
    assert Catalog(system).search(info.name, query, k=1, field="sp")["doc"].tolist() == [best]
    # A search within one tenant opens its partition only and returns that tenant's rows.
    near = fields.vector_matrix(EVERY.field("f32"), rows["f32"].take([by_doc[wanted[0]]]))
    one = Catalog(system).search(info.name, near, k=20, field="f32", filter="tenant == 't3'")
    assert len(one) == 20 and set(
        table.filter(pc.is_in(table["doc"], pa.array(one["doc"])))["tenant"].to_pylist()
    ) == {"t3"}


def _assert_values(info: CollectionInfo, table: pa.Table, rows: pa.Table) -> None:
    """Sampled rows read back as inserted: scalars equal (a null float as its default 0.5),
    vectors byte for byte at their own width, the unknown `color` in the dynamic field."""
    order = {doc: i for i, doc in enumerate(table["doc"].to_pylist())}
    checked = 0
    for i in range(0, rows.num_rows, 97):
        doc = rows["doc"][i].as_py()
        if doc not in order:
            continue  # deleted
        got = table.slice(order[doc], 1).to_pylist()[0]
        for field in info.schema.fields:
            if field.is_dynamic:
                continue
            want = rows[field.name][i].as_py()
            if field.name == "f" and want is None:
                want = 0.5
            if field.name == "j" and want is not None:
                assert json.loads(got["j"]) == json.loads(want)
            elif isinstance(want, float):
                assert abs(got[field.name] - want) < 1e-6 * max(1.0, abs(want)), field.name
            else:
                assert got[field.name] == want, field.name
        color = rows["color"][i].as_py()
        assert (json.loads(got[DYNAMIC_FIELD]) if got[DYNAMIC_FIELD] else {}).get("color") == color
        checked += 1
    assert checked > 30
