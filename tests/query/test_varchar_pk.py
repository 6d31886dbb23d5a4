"""VarChar primary keys through every path: routing by the key's hash, deletes by key,
stats logs (text min/max, bloom filter of the keys' hashes), sort, L0 delete application
and mix compaction, pushdown, import and upsert, the change stream, Spark and search.
Real etcd, real files, a real local Spark."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.datanode.stats import PkStats
from vchan_assets.imports.jobs import ImportState
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentLevel, SegmentState
from vchan_assets.query.prune import FilterError
from vchan_assets.query.spark_source import spark_session
from vchan_assets.query.stream_source import VchanStreamReader
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.import_files import run_import, write_parquet
from vchan_assets.testing.steps import compact_all, new_collection, sync_all
from vchan_assets.testing.streams import stream_options
from vchan_assets.wal.producer import Producer, generate_rows

DOCS = CollectionSchema.build(
    "doc_id", {"vec": 4}, {"n": "int64", "title": "varchar(16)"}, pk_type="varchar(36)"
)


def doc_rows(n: int, seed: int) -> pa.Table:
    """`n` rows with UUID keys (36 characters, as document ids are)."""
    rng = np.random.default_rng(seed)
    table = generate_rows(DOCS, n, seed=seed)
    keys = pa.array([str(uuid.UUID(int=int(rng.integers(0, 2**62)) << 64 | i)) for i in range(n)])
    return table.set_column(0, "doc_id", keys)


@pytest.fixture
def docs(producer: Producer, system: System) -> tuple[CollectionInfo, pa.Table, list[str]]:
    """400 rows over 2 vchannels, 25 of them deleted by key, flushed and synced: the
    collection, the rows inserted, the keys deleted."""
    info = new_collection(producer, schema=DOCS, prefix="docs")
    rows = doc_rows(400, seed=7)
    producer.insert(info.name, rows)
    deleted = rows["doc_id"].to_pylist()[::16]
    producer.delete(info.name, deleted)
    producer.flush(info.name)
    sync_all(system, info)
    return info, rows, deleted


def visible_keys(system: System, info: CollectionInfo, **where: object) -> list[str]:
    frame = Catalog(system).read_collection(info.name, **where)
    return sorted(frame["doc_id"])


def test_rows_go_to_every_vchannel_by_the_keys_hash_and_deletes_by_key_apply(
    system: System, docs: tuple[CollectionInfo, pa.Table, list[str]]
) -> None:
    info, rows, deleted = docs
    per_channel = {
        v: sum(
            s.num_rows for s in segments(system.store, info) if s.vchannel == v and s.level is SegmentLevel.L1
        )
        for v in info.vchannels
    }
    assert sum(per_channel.values()) == 400 and min(per_channel.values()) > 100  # both get a share
    assert visible_keys(system, info) == sorted(set(rows["doc_id"].to_pylist()) - set(deleted))


def test_stats_logs_hold_the_text_range_and_a_bloom_filter_of_the_keys(
    system: System, docs: tuple[CollectionInfo, pa.Table, list[str]]
) -> None:
    info, rows, _ = docs
    flushed = [s for s in segments(system.store, info) if s.level is SegmentLevel.L1]
    keys = np.asarray(rows["doc_id"].to_pylist(), dtype=object)
    hits = np.zeros(len(keys), dtype=bool)
    for seg in flushed:
        stats = PkStats.from_bytes(system.storage.read_bytes(seg.statslogs[0].path))
        assert isinstance(stats.pk_min, str) and stats.pk_min <= stats.pk_max
        hits |= stats.might_contain(keys)
    assert hits.all()  # no false negative
    absent = np.asarray([str(uuid.uuid4()) for _ in range(2000)], dtype=object)
    stats = PkStats.from_bytes(system.storage.read_bytes(flushed[0].statslogs[0].path))
    assert stats.might_contain(absent).mean() < 0.01


def test_binlogs_give_the_keys_no_dictionary_and_repeating_text_one(
    system: System, docs: tuple[CollectionInfo, pa.Table, list[str]]
) -> None:
    """Unique keys would fill a dictionary, overflow it and have it thrown away (a slower
    write); the titles (100 words) are what a dictionary is for."""
    info, _, _ = docs
    seg = next(s for s in segments(system.store, info) if s.level is SegmentLevel.L1)
    scalars = system.storage.path(seg.binlogs[0].logs[0].path)
    chunks = pq.ParquetFile(scalars).metadata.row_group(0)
    encodings = {
        chunks.column(i).path_in_schema: chunks.column(i).encodings for i in range(chunks.num_columns)
    }
    assert "RLE_DICTIONARY" not in encodings["doc_id"], encodings
    assert "RLE_DICTIONARY" in encodings["title"], encodings


def test_pushdown_on_a_varchar_key_finds_its_rows(
    system: System, docs: tuple[CollectionInfo, pa.Table, list[str]]
) -> None:
    info, rows, deleted = docs
    live = sorted(set(rows["doc_id"].to_pylist()) - set(deleted))
    assert visible_keys(system, info, where=[("doc_id", "=", live[3])]) == [live[3]]
    assert visible_keys(system, info, where=[("doc_id", "in", [live[0], deleted[0]])]) == [live[0]]
    assert visible_keys(system, info, where=[("doc_id", ">=", live[-5])]) == live[-5:]
    with pytest.raises(FilterError, match="is not a VarChar primary key"):
        Catalog(system).read_collection(info.name, where=[("doc_id", "=", 42)])


def test_sort_l0_and_mix_compaction_order_by_key_and_drop_the_deleted_rows(
    system: System, docs: tuple[CollectionInfo, pa.Table, list[str]]
) -> None:
    info, rows, deleted = docs
    CompactionTrigger(system).trigger(info, CompactionType.L0, manual=True)
    assert all(o.state is PlanState.COMPLETED for o in CompactionExecutor(system, "local").run_pending())
    compact_all(system, info)
    live = [
        s
        for s in segments(system.store, info)
        if s.state is SegmentState.FLUSHED and s.level is SegmentLevel.L1
    ]
    assert live and all(s.is_sorted for s in live)
    for seg in live:
        keys = system.storage.read_parquet(seg.binlogs[0].logs[0].path)["doc_id"].to_pylist()
        assert keys == sorted(keys) and not set(keys) & set(deleted)
    assert sum(s.num_rows for s in live) == 400 - len(deleted)
    assert visible_keys(system, info) == sorted(set(rows["doc_id"].to_pylist()) - set(deleted))


def test_spark_the_change_stream_and_search_return_the_keys_as_text(
    system: System, docs: tuple[CollectionInfo, pa.Table, list[str]]
) -> None:
    info, rows, deleted = docs
    live = sorted(set(rows["doc_id"].to_pylist()) - set(deleted))
    spark_session(system)
    picked = Catalog(system).spark_collection(info.name, with_vectors=False, pks=f"{live[1]},{live[2]}")
    assert sorted(r["doc_id"] for r in picked.collect()) == live[1:3]

    reader = VchanStreamReader(stream_options(system.settings, system.store, info.name, fields="title"))
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    changes = pa.Table.from_batches([b for p in reader.partitions(start, end) for b in reader.read(p)])
    deletes = changes.filter(pc.equal(changes["op"], "delete"))
    assert changes.schema.field("doc_id").type == pa.string()
    assert sorted(deletes["doc_id"].to_pylist()) == sorted(deleted)

    vectors = rows["vec"].combine_chunks()
    query = np.frombuffer(vectors[rows["doc_id"].to_pylist().index(live[0])].as_py(), dtype="<f4")
    hits = Catalog(system).search(info.name, query, k=3)
    assert hits["doc_id"].iloc[0] == live[0]


def test_an_import_and_an_upsert_by_varchar_key(system: System, producer: Producer, tmp_path: Path) -> None:
    info = new_collection(producer, schema=DOCS, prefix="docs")
    rows = doc_rows(100, seed=9)
    first = run_import(system.store, system.settings, info, [write_parquet(tmp_path / "a.parquet", rows)])
    assert first.state is ImportState.COMPLETED, first.reason
    changed = rows.slice(0, 10).set_column(
        rows.schema.get_field_index("n"), "n", pa.array([-1] * 10, pa.int64())
    )
    again = run_import(
        system.store, system.settings, info, [write_parquet(tmp_path / "b.parquet", changed)], upsert=True
    )
    assert again.state is ImportState.COMPLETED, again.reason
    frame = Catalog(system).read_collection(info.name)
    assert len(frame) == 100 and frame["doc_id"].is_unique
    assert set(frame[frame["n"] == -1]["doc_id"]) == set(changed["doc_id"].to_pylist())

    twice = rows.slice(0, 3)
    job = run_import(
        system.store,
        system.settings,
        info,
        [write_parquet(tmp_path / "c.parquet", pa.concat_tables([twice, twice]))],
    )
    assert job.state is ImportState.FAILED and "appears more than once in the job" in job.reason
    assert any(f"primary key {key} appears" in job.reason for key in twice["doc_id"].to_pylist())


def test_a_key_over_max_length_or_not_text_is_refused_with_nothing_written(
    producer: Producer, system: System
) -> None:
    info = new_collection(producer, schema=DOCS, prefix="docs")
    rows = doc_rows(3, seed=1)
    long = rows.set_column(0, "doc_id", pa.array(["a", "b", "x" * 37]))
    with pytest.raises(
        ValueError, match=r"field 'doc_id': is 37 bytes long, over its max_length of 36 \(row 2\)"
    ):
        producer.insert(info.name, long)
    numbers = rows.set_column(0, "doc_id", pa.array([1, 2, 3]))
    with pytest.raises(ValueError, match="field 'doc_id': is int64, not text"):
        producer.insert(info.name, numbers)
    with pytest.raises(ValueError, match="primary keys of 'doc_id' must be varchar"):
        producer.delete(info.name, [1, 2])
    producer.flush(info.name)
    sync_all(system, info)
    assert Catalog(system).read_collection(info.name).empty
