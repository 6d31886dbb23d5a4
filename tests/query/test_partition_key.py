"""Milvus' partition key: rows go to hidden partitions by their key's hash, and reads and
searches that require a key's value open only the partition it hashes to. Real etcd, real
files."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets import imports
from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.collections import InvalidSchemaError
from vchan_assets.fields import vchannel_index
from vchan_assets.imports.checks import check_no_existing_pks, check_rows_match_files
from vchan_assets.imports.files import FileSource
from vchan_assets.imports.jobs import KEY_PARTITIONS, ImportState
from vchan_assets.model import CollectionInfo, CollectionSchema, DataType, SegmentLevel
from vchan_assets.query.filters import key_partitions_of
from vchan_assets.storage import StorageError
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env, segments
from vchan_assets.testing.import_files import run_import, write_parquet
from vchan_assets.testing.steps import reads, sync_all, write_segments
from vchan_assets.wal.producer import Producer, generate_rows

TENANTS = CollectionSchema.build(
    "pk", {"vec": 4}, {"tenant": "varchar(16)", "n": "int64"}, partition_key="tenant"
)


@pytest.fixture
def tenants(producer: Producer, system: System) -> tuple[CollectionInfo, pa.Table]:
    """400 rows of 10 tenants (pk i belongs to tenant t{i % 10}) in 4 hidden partitions over
    2 vchannels, pks 0 and 1 deleted, flushed and synced."""
    info = producer.create_collection(
        f"tenants{uuid.uuid4().hex[:6]}", TENANTS, num_channels=2, num_partitions=4
    )
    rows = generate_rows(TENANTS, 400, seed=1)
    rows = rows.set_column(
        rows.schema.get_field_index("tenant"), "tenant", pa.array([f"t{i % 10}" for i in range(400)])
    )
    producer.insert(info.name, rows)
    producer.delete(info.name, [0, 1])
    producer.flush(info.name)
    sync_all(system, info)
    return info, rows


def test_rows_go_to_the_hidden_partition_their_key_hashes_to(
    system: System, tenants: tuple[CollectionInfo, pa.Table]
) -> None:
    info, _ = tenants
    assert info.partition_names == ("_default_0", "_default_1", "_default_2", "_default_3")
    frame = Catalog(system).read_collection(info.name, with_vectors=False)
    assert len(frame) == 398
    expected = [
        info.partitions[i] for i in vchannel_index(frame["tenant"].to_numpy(dtype=object), 4).tolist()
    ]
    assert frame["partition_id"].tolist() == expected
    assert len(set(frame["partition_id"])) > 1  # the tenants spread over the partitions
    [row] = Catalog(system).collections().query(f"name == '{info.name}'").to_dict("records")
    assert row["partition_key"] == "tenant" and len(row["partitions"]) == 4


def test_reads_and_searches_on_a_key_open_only_its_partition(
    system: System, tenants: tuple[CollectionInfo, pa.Table]
) -> None:
    info, _ = tenants
    [mine] = key_partitions_of(info, "tenant == 't3' and n > 0")
    # The other partitions' files are gone: a read or search that opened them would fail.
    for seg in segments(system.store, info):
        if seg.partition_id != mine and seg.level is SegmentLevel.L1:
            for path in (b.path for g in seg.binlogs for b in g.logs):
                Path(system.storage.path(path)).unlink()
    catalog = Catalog(system)
    one = catalog.read_collection(info.name, where=[("tenant", "=", "t3")])
    assert set(one["tenant"]) == {"t3"} and sorted(one["pk"]) == list(range(3, 400, 10))
    hits = catalog.search(
        info.name, np.ones(4, dtype=np.float32), k=50, filter="tenant == 't3'", output_fields=("tenant",)
    )
    assert len(hits) == 40 and set(hits["tenant"]) == {"t3"}
    with pytest.raises(Exception):  # noqa: B017 (the point: a whole read touches the files removed)
        catalog.read_collection(info.name)


def test_a_search_on_a_key_lists_only_its_partitions_meta(
    system: System, tenants: tuple[CollectionInfo, pa.Table]
) -> None:
    """The plan of a search pruned by the key lists the kept partition's segments, dropped
    records and index builds, not the collection's: 300 segments written to another
    partition (meta only: their files do not exist) add no key to what it reads."""
    info, _ = tenants
    other = info.partitions[0]
    tenant = next(f"t{i}" for i in range(10) if key_partitions_of(info, f"tenant == 't{i}'") != {other})
    catalog = Catalog(system)

    def search() -> pa.Table:
        query = np.ones(4, dtype=np.float32)
        return catalog.search(info.name, query, k=50, filter=f"tenant == '{tenant}'", as_arrow=True)

    before = search()
    keys_before, _ = reads(system.store, search)
    write_segments(system.store, info, info.vchannels[0], 300, first=50_000_000)
    assert {s.partition_id for s in segments(system.store, info) if s.id >= 50_000_000} == {other}
    keys_after, _ = reads(system.store, search)
    assert keys_after <= keys_before + 2, (keys_before, keys_after)  # not the 300 segments
    assert search().equals(before) and before.num_rows >= 39  # (40 rows a tenant, pks 0 and 1 deleted)
    with pytest.raises(StorageError, match="50000000"):  # an unpruned search lists them, opens them
        catalog.search(info.name, np.ones(4, dtype=np.float32), k=5)


def test_a_partition_key_collection_has_no_partitions_of_its_own(
    system: System, producer: Producer, tenants: tuple[CollectionInfo, pa.Table], tmp_path: Path
) -> None:
    info, rows = tenants
    with pytest.raises(ValueError, match="its rows choose their partitions"):
        producer.insert(info.name, rows.slice(0, 1), partition="_default_1")
    with pytest.raises(InvalidSchemaError, match="its partitions follow its partition key 'tenant'"):
        producer.create_partition(info.name, "p1")
    with pytest.raises(ValueError, match="an import names no partition"):
        imports.submit(
            info.name,
            [write_parquet(tmp_path / "t.parquet", rows)],
            partition="_default_1",
            store=system.store,
            settings=system.settings,
        )
    with pytest.raises(ValueError, match="partition key 'd' must be an int64 or varchar field"):
        CollectionSchema.build("pk", {"vec": 4}, {"d": "double"}, partition_key="d")
    with pytest.raises(ValueError, match="partition key 'pk' is not one of the scalar fields"):
        CollectionSchema.build("pk", {"vec": 4}, {"d": "double"}, partition_key="pk")


def _tenant_rows(pks: range, tenant: str | None = None) -> pa.Table:
    """Rows of TENANTS with pks `pks`: tenant t{pk % 10}, or `tenant` for every row."""
    rows = generate_rows(TENANTS, len(pks), start_pk=pks.start, seed=pks.start)
    tenants = [tenant or f"t{pk % 10}" for pk in pks]
    return rows.set_column(rows.schema.get_field_index("tenant"), "tenant", pa.array(tenants))


def test_an_import_routes_each_row_to_the_partition_its_key_hashes_to(
    system: System, tenants: tuple[CollectionInfo, pa.Table], tmp_path: Path
) -> None:
    """Bulk import into a partition-key collection, as Milvus: each row to the hidden
    partition its key picks, as an insert would; reads pruned by the key find them; the
    job's checks pass; the job names each segment's partition."""
    info, _ = tenants
    paths = [
        write_parquet(tmp_path / f"{i}.parquet", _tenant_rows(range(400 + 100 * i, 500 + 100 * i)))
        for i in range(2)
    ]
    job = run_import(system.store, system.settings, info, paths)

    assert job.state is ImportState.COMPLETED and job.imported_rows == 200
    assert job.partition_id == KEY_PARTITIONS
    assert len(set(job.segment_partitions)) > 1 and set(job.segment_partitions) <= set(info.partitions)
    frame = Catalog(system).read_collection(info.name, with_vectors=False)
    assert sorted(frame["pk"]) == list(range(2, 600))
    expected = [
        info.partitions[i] for i in vchannel_index(frame["tenant"].to_numpy(dtype=object), 4).tolist()
    ]
    assert frame["partition_id"].tolist() == expected
    t3 = Catalog(system).read_collection(info.name, where=[("tenant", "=", "t3")], with_vectors=False)
    assert sorted(t3["pk"]) == list(range(3, 600, 10))
    assert check_no_existing_pks(system.store, system.storage, job).passed
    assert check_rows_match_files(system.store, system.storage, FileSource(), job).passed


def test_an_upsert_import_replaces_a_row_whose_key_moved_it_to_another_partition(
    system: System, tenants: tuple[CollectionInfo, pa.Table], tmp_path: Path
) -> None:
    """pks 2..21 imported again with tenant `t_new`: their old versions, in the partitions of
    their old tenants, are deleted (the upsert's deletes go to every hidden partition), so
    each pk is read once, with its new tenant."""
    info, _ = tenants
    moved = write_parquet(tmp_path / "moved.parquet", _tenant_rows(range(2, 22), tenant="t_new"))
    job = run_import(system.store, system.settings, info, [moved], upsert=True)

    assert job.state is ImportState.COMPLETED
    frame = Catalog(system).read_collection(info.name, with_vectors=False)
    assert sorted(frame["pk"]) == list(range(2, 400))
    assert set(frame[frame["pk"] < 22]["tenant"]) == {"t_new"}
    assert check_no_existing_pks(system.store, system.storage, job).passed


def test_a_plain_import_of_live_pks_in_other_partitions_fails_its_overlap_check(
    system: System, tenants: tuple[CollectionInfo, pa.Table], tmp_path: Path
) -> None:
    info, _ = tenants
    moved = write_parquet(tmp_path / "moved.parquet", _tenant_rows(range(2, 22), tenant="t_new"))
    job = run_import(system.store, system.settings, info, [moved])
    overlap = check_no_existing_pks(system.store, system.storage, job)
    assert not overlap.passed and overlap.metadata["overlap"] == 20
    assert "already live in the collection" in overlap.description


def test_the_cli_creates_a_partition_key_collection_of_num_partitions_and_a_sparse_field(
    system: System,
) -> None:
    """`--num-partitions` was parsed and then not passed on: every such collection got 16."""

    def create(name: str, *args: str) -> CollectionInfo:
        made = subprocess.run(
            [str(VCHAN), "create-collection", "--collection", name, *args],
            env=cli_env(system.settings),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert made.returncode == 0, made.stderr
        return Catalog(system).collection(name)

    keyed = ("--scalars", "tenant:varchar(16),n:int64", "--partition-key", "tenant", "--num-partitions", "4")
    info = create(f"cli{uuid.uuid4().hex[:6]}", *keyed)
    assert info.partition_names == ("_default_0", "_default_1", "_default_2", "_default_3")
    sparse = create(f"cli{uuid.uuid4().hex[:6]}", "--vector-type", "sparse")
    assert sparse.schema.field("vector").dtype is DataType.SPARSE_FLOAT_VECTOR
