"""Index meta: one index per vector field, created idempotently, refused with a clear error
when it cannot be, soft-dropped; a build per sorted segment, none of it for what needs no
files."""

from __future__ import annotations

import json
import subprocess

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionNotFoundError
from vchan_assets.indexes.meta import (
    IndexConflictError,
    IndexNotFoundError,
    InvalidIndexError,
    create_index,
    create_missing_builds,
    drop_index,
    list_builds,
    list_indexes,
)
from vchan_assets.model import CollectionInfo, IndexParam, IndexType, MetricType, SegmentIndexState
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.index_data import Data, clustered, live_sorted, sorted_segments
from vchan_assets.testing.steps import sync_all
from vchan_assets.wal.producer import Producer


def test_create_index_stores_its_definition(system: System, data: Data) -> None:
    index, created, builds = create_index(system.store, data.info, "vec", "hnsw", "cosine", {"M": 8})

    assert created and builds == []  # no sorted segment yet
    assert (index.name, index.field, index.type, index.metric) == (
        "vec",
        "vec",
        IndexType.HNSW,
        MetricType.COSINE,
    )
    assert index.params == (IndexParam("M", 8),)
    stored = list_indexes(system.store, data.info.id)
    assert [d.model for d in stored] == [index]
    assert stored[0].kv.key == system.store.keys.field_index(data.info.id, index.index_id)


def test_the_same_create_again_returns_the_existing_index(system: System, data: Data) -> None:
    first, _, _ = create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 16})
    again, created, _ = create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 16})

    assert not created and again.index_id == first.index_id
    assert len(list_indexes(system.store, data.info.id)) == 1


@pytest.mark.parametrize(
    ("kind", "metric", "params", "name"),
    [
        ("IVF_FLAT", "L2", {"nlist": 32}, None),  # other params
        ("HNSW", "L2", {}, None),  # other type
        ("IVF_FLAT", "IP", {"nlist": 16}, None),  # other metric
        ("IVF_FLAT", "L2", {"nlist": 16}, "other"),  # other name on the same field
    ],
)
def test_another_definition_for_the_field_is_a_conflict(
    system: System, data: Data, kind: str, metric: str, params: dict[str, object], name: str | None
) -> None:
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 16})

    with pytest.raises(IndexConflictError, match=r"index 'vec' on 'vec' \(IVF_FLAT, L2, nlist=16\) exists"):
        create_index(system.store, data.info, "vec", kind, metric, params, name)


@pytest.mark.parametrize(
    ("field", "kind", "metric", "params", "message"),
    [
        ("vec", "IVF_FLAT", "L2", {"nlist": 0}, r"nlist=0 is out of range \[1, 65536\]"),
        ("vec", "IVF_FLAT", "L2", {"nprobe": 8}, "IVF_FLAT takes nlist as build parameters, not 'nprobe'"),
        ("vec", "IVF_PQ", "L2", {"m": 5}, "m=5 must divide the dimension 16"),
        ("vec", "HNSW", "L2", {"M": 1}, r"M=1 is out of range \[2, 2048\]"),
        ("vec", "FLAT", "L2", {"M": 8}, "FLAT takes no parameters"),
        ("vec", "HNSW", "L2", {"M": "8"}, "M must be an integer"),
        (
            "vec",
            "DISKANN",
            "L2",
            {},
            "unknown index type 'DISKANN': one of FLAT, IVF_FLAT, IVF_PQ, HNSW, SPARSE_INVERTED_INDEX, "
            "SPARSE_WAND, BIN_FLAT, BIN_IVF_FLAT",
        ),
        (
            "vec",
            "HNSW",
            "MANHATTAN",
            {},
            "unknown metric 'MANHATTAN': one of L2, IP, COSINE, HAMMING, JACCARD",
        ),
        ("n", "HNSW", "L2", {}, "it is a int64 field, not a vector field"),
        ("nope", "HNSW", "L2", {}, r"no such field \(vector fields: vec\)"),
    ],
)
def test_invalid_indexes_are_refused_before_anything_is_written(
    system: System, data: Data, field: str, kind: str, metric: str, params: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidIndexError, match=message) as caught:
        create_index(system.store, data.info, field, kind, metric, params)

    assert str(caught.value).startswith(f"cannot index {data.info.name}.{field}: ")
    assert list_indexes(system.store, data.info.id, include_deleted=True) == []


def test_an_index_on_a_collection_that_is_gone_is_refused(
    system: System, data: Data, producer: Producer
) -> None:
    producer.drop_collection(data.info.name)

    with pytest.raises(CollectionNotFoundError):
        create_index(system.store, data.info, "vec", "HNSW", "L2")


def test_drop_index_is_a_soft_delete_that_frees_the_field(system: System, data: Data) -> None:
    first, _, _ = create_index(system.store, data.info, "vec", "HNSW", "L2")

    dropped = drop_index(system.store, data.info, field="vec")

    assert dropped.index_id == first.index_id
    assert list_indexes(system.store, data.info.id) == []
    [kept] = list_indexes(system.store, data.info.id, include_deleted=True)
    assert kept.model.deleted and kept.model.deleted_at
    second, created, _ = create_index(system.store, data.info, "vec", "IVF_FLAT", "IP")
    assert created and second.index_id != first.index_id
    with pytest.raises(IndexNotFoundError, match="has no index named 'vec2'"):
        drop_index(system.store, data.info, name="vec2")


def test_create_makes_one_build_per_sorted_segment_and_none_twice(
    system: System, producer: Producer, data: Data
) -> None:
    sorted_segments(system, producer, data, [1500, 300])
    index, _, builds = create_index(system.store, data.info, "vec", "HNSW", "L2")

    again = create_missing_builds(system.store, data.info, [index])
    _, created, existing = create_index(system.store, data.info, "vec", "HNSW", "L2")

    segments = {s.id: s for s in live_sorted(system, data.info)}
    assert sorted(b.segment_id for b in builds) == sorted(segments)
    assert again == [] and not created and existing == []
    states = {segments[b.segment_id].num_rows: b.state for b in builds}
    # under 1,024 rows: nothing to build, Finished without files at once
    assert states == {1500: SegmentIndexState.UNISSUED, 300: SegmentIndexState.FINISHED}
    assert all(not b.files for b in builds)
    stored = list_builds(system.store, data.info.id)
    assert {d.model.build_id for d in stored} == {b.build_id for b in builds}


def test_flat_builds_are_finished_without_files(system: System, producer: Producer, data: Data) -> None:
    sorted_segments(system, producer, data, [1500])
    _, _, [build] = create_index(system.store, data.info, "vec", "FLAT", "IP")

    assert build.state is SegmentIndexState.FINISHED and build.files == () and build.rows == 1500


def test_no_build_is_made_for_a_dropped_index(system: System, producer: Producer, data: Data) -> None:
    index, _, _ = create_index(system.store, data.info, "vec", "HNSW", "L2")
    drop_index(system.store, data.info, field="vec")
    sorted_segments(system, producer, data, [1500])

    assert create_missing_builds(system.store, data.info, [index]) == []


def test_catalog_and_cli_describe_an_index(
    system: System, settings: Settings, producer: Producer, data: Data
) -> None:
    sorted_segments(system, producer, data, [1500, 300])
    insert_unsorted(producer, system, data.info)

    run = create_with_cli(settings, data, "--type", "hnsw", "--param", "M=8")
    assert run.returncode == 0, run.stderr
    assert "created index 'vec' on 'vec' (HNSW, L2, M=8)" in run.stdout
    assert "2 new segment builds: 1 to build, 1 with nothing to build" in run.stdout

    described = vchan(settings, "describe-index", "--collection", data.info.name)
    assert "indexed rows 300 / 2000 (15%)" in described.stdout, described.stdout
    assert "segments 3: 1 finished, 1 pending, 0 in progress, 0 failed, 1 waiting" in described.stdout
    [row] = json.loads(vchan(settings, "describe-index", "--collection", data.info.name, "--json").stdout)
    table = Catalog(system).indexes(data.info.name)
    assert table.to_dict("records")[0]["indexed_rows"] == row["indexed_rows"] == 300
    assert row["params"] == {"M": 8} and row["pending"] == 1

    bad = create_with_cli(settings, data, "--type", "IVF_FLAT")
    assert bad.returncode == 1 and "index 'vec' on 'vec' (HNSW, L2, M=8) exists" in bad.stderr
    bad = create_with_cli(settings, data, "--type", "HNSW", "--param", "M")
    assert bad.returncode == 1 and "--param 'M': expected name=integer (or a float)" in bad.stderr

    dropped = vchan(settings, "drop-index", "--collection", data.info.name, "--field", "vec")
    assert dropped.returncode == 0 and "dropped index 'vec'" in dropped.stdout
    assert "no indexes" in vchan(settings, "describe-index", "--collection", data.info.name).stdout


def insert_unsorted(producer: Producer, system: System, info: CollectionInfo) -> None:
    """A flushed segment of 200 rows that is not sorted yet (its build waits)."""
    rows = {"pk": list(range(900_000, 900_200)), "vec": clustered(200, 7), "n": [1] * 200, "tag": ["x"] * 200}
    producer.insert(info.name, rows)
    producer.flush(info.name)
    sync_all(system, info)


def create_with_cli(settings: Settings, data: Data, *args: str) -> subprocess.CompletedProcess[str]:
    return vchan(settings, "create-index", "--collection", data.info.name, "--field", "vec", *args)


def vchan(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VCHAN), *args], env=cli_env(settings), capture_output=True, text=True, timeout=120
    )


def test_concurrent_creates_on_one_field_make_one_index(system: System, data: Data) -> None:
    from concurrent.futures import ThreadPoolExecutor

    kinds = ["HNSW", "IVF_FLAT", "IVF_PQ", "FLAT"] * 2

    def create(kind: str) -> str:
        try:
            create_index(system.store, data.info, "vec", kind, "L2")
            return kind
        except IndexConflictError:
            return "conflict"

    with ThreadPoolExecutor(len(kinds)) as pool:
        outcomes = list(pool.map(create, kinds))

    [index] = list_indexes(system.store, data.info.id)
    assert outcomes.count(index.model.type.value) == 2 and outcomes.count("conflict") == 6
