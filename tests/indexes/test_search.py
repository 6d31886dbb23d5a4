"""Search over the query view at a timestamp: indexed segments through faiss, everything
else exactly, deletes applied, the k best merged; clear errors for requests that cannot run."""

from __future__ import annotations

import json
import subprocess
import warnings
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.tasks import TaskScheduler, list_tasks
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.step import IndexBuilder
from vchan_assets.indexes.tasks import IndexTasks
from vchan_assets.meta.codec import decode
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ReadPin, SegmentIndex, SegmentIndexState
from vchan_assets.query.search import IndexFallbackWarning, SearchError
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.index_data import (
    DIM,
    Data,
    clustered,
    exact_neighbours,
    insert,
    new_data,
    sorted_segments,
)
from vchan_assets.testing.steps import reads, requests, sync_all
from vchan_assets.wal.producer import Producer

K = 10
QUERIES = clustered(40, seed=999)


@pytest.fixture
def data(system: System, producer: Producer) -> Data:
    """Three sorted segments (2,000, 1,500 and 1,100 rows) of clustered vectors."""
    data = new_data(producer)
    sorted_segments(system, producer, data, [2000, 1500, 1100])
    return data


def indexed(system: System, data: Data, kind: str = "HNSW", metric: str = "L2", **params: int) -> None:
    create_index(system.store, data.info, "vec", kind, metric, params)
    report = IndexBuilder(system, "local").run()
    assert len(report.finished) == 3 and not report.failed


def hits(frame: pd.DataFrame, queries: int = len(QUERIES)) -> list[set[int]]:
    return [set(frame.loc[frame["query"] == q, "pk"]) for q in range(queries)]


def recall(found: list[set[int]], truth: list[set[int]]) -> float:
    return float(np.mean([len(f & t) / len(t) for f, t in zip(found, truth, strict=True)]))


@pytest.mark.parametrize(("kind", "floor"), [("HNSW", 0.9), ("IVF_FLAT", 0.9), ("IVF_PQ", 0.5)])
def test_recall_through_the_indexes_against_exact_search(
    system: System, data: Data, kind: str, floor: float
) -> None:
    indexed(system, data, kind)

    frame = Catalog(system).search(data.info.name, QUERIES, k=K)

    assert list(frame.columns) == ["query", "pk", "distance"]
    assert frame.groupby("query").size().eq(K).all() and frame["query"].nunique() == len(QUERIES)
    assert recall(hits(frame), exact_neighbours(data, QUERIES, K)) >= floor
    assert (frame.groupby("query")["distance"].diff().dropna() >= 0).all(), "nearest first"


def test_without_an_index_search_is_exact(system: System, data: Data) -> None:
    frame = Catalog(system).search(data.info.name, QUERIES, k=K)

    assert hits(frame) == exact_neighbours(data, QUERIES, K)
    pks, vectors = data.live()
    row = frame.iloc[0]
    true = float(((vectors[pks == row["pk"]][0] - QUERIES[int(row["query"])]) ** 2).sum())
    assert row["distance"] == pytest.approx(true, rel=1e-4)


def test_back_to_back_searches_share_one_read_pin_and_a_search_in_the_past_takes_its_own(
    system: System, data: Data
) -> None:
    catalog = Catalog(replace(system, settings=replace(system.settings, time_travel=3600.0)))
    pins = system.store.keys.read_pin.prefix
    first = catalog.search(data.info.name, QUERIES[:2], k=K)
    [pin] = system.store.list_prefix(pins).items
    assert catalog.search(data.info.name, QUERIES[:2], k=K).equals(first)
    assert system.store.list_prefix(pins).items == [pin], "the second search took the first's pin"
    past = decode(pin.key, pin.value, ReadPin).as_of - 1
    catalog.search(data.info.name, QUERIES[:2], k=K, as_of=past)  # before the pin's time
    assert len(system.store.list_prefix(pins).items) == 2


def test_a_repeated_search_plans_in_three_etcd_requests(system: System, data: Data) -> None:
    """A search's planning cost is its etcd round trips: the collection by name (with the
    record it named last time), "now" from the timestamp oracle, then every vchannel's
    checkpoint and the first pages of the segments, indexes and builds in one transaction;
    the read pin is shared by back-to-back searches. Eight before on this collection of one
    vchannel: a request for the name, one for the record, one per vchannel and one per
    listed prefix (live and dropped segments, indexes, builds); four with the checkpoints in
    a transaction of their own."""
    indexed(system, data)
    catalog = Catalog(system)
    first = catalog.search(data.info.name, QUERIES[:2], k=K)
    found: list[pd.DataFrame] = []
    sent = requests(system.store, lambda: found.append(catalog.search(data.info.name, QUERIES[:2], k=K)))
    assert found[0].equals(first)
    assert len(sent) == 3, sent


def test_a_catalog_holding_segment_meta_plans_from_it_and_sees_another_clients_sync_at_once(
    system: System, producer: Producer, data: Data
) -> None:
    """`Catalog.hold_segment_meta`: a search plans from the segment meta held in memory (the
    DataCoord's copy, following etcd) and reads no segment value from etcd, with the same
    hits as a catalog that lists etcd; a segment another client syncs is searched by the
    next call."""
    indexed(system, data)
    plain = Catalog(system)
    store = MetaStore.connect(system.settings)
    held = Catalog(replace(system, store=store)).hold_segment_meta(timeout=30)
    try:
        expected = plain.search(data.info.name, QUERIES[:5], k=K)
        assert held.search(data.info.name, QUERIES[:5], k=K).equals(expected)
        segments = len(system.store.list_prefix(system.store.keys.segment.under(data.info.id)).items)
        assert segments >= 3
        listed = reads(system.store, lambda: plain.search(data.info.name, QUERIES[:5], k=K))
        from_memory = reads(store, lambda: held.search(data.info.name, QUERIES[:5], k=K))
        assert from_memory[0] <= listed[0] - segments, (from_memory, listed)

        insert(producer, data, 300, start_pk=50_000)
        sync_all(system, data.info)  # another client's: a growing segment with binlogs
        frame = held.search(data.info.name, data.vectors[-1][:3], k=1)
        assert frame["pk"].tolist() == [50_000, 50_001, 50_002]
    finally:
        held.close()
    assert store.segment_cache is None  # released


def test_hnsw_returns_the_exact_distances(system: System, data: Data) -> None:
    exact = Catalog(system).search(data.info.name, QUERIES[:3], k=K)  # no index yet
    indexed(system, data)

    found = Catalog(system).search(data.info.name, QUERIES[:3], k=K, params={"ef": 200})

    both = exact.merge(found, on=["query", "pk"], suffixes=("_exact", "_hnsw"))
    assert len(both) >= 0.9 * len(exact)
    assert np.allclose(both["distance_exact"], both["distance_hnsw"], rtol=1e-4)


def test_deleted_rows_are_never_returned(system: System, producer: Producer, data: Data) -> None:
    indexed(system, data)
    nearest = sorted(set().union(*exact_neighbours(data, QUERIES[:5], 3)))
    producer.delete(data.info.name, nearest[: len(nearest) // 2], partition="_default")
    sync_all(system, data.info)  # deletes in an L0 segment
    producer.delete(data.info.name, nearest[len(nearest) // 2 :], partition="_default")  # in the log only
    data.deleted |= set(nearest)

    frame = Catalog(system).search(data.info.name, QUERIES, k=K)

    assert not set(frame["pk"]) & set(nearest)
    assert frame.groupby("query").size().eq(K).all(), "k hits per query all the same"
    assert recall(hits(frame), exact_neighbours(data, QUERIES, K)) >= 0.9


def test_rows_only_in_the_log_tail_and_in_growing_segments_are_found(
    system: System, producer: Producer, data: Data
) -> None:
    indexed(system, data)
    insert(producer, data, 300, start_pk=50_000)
    sync_all(system, data.info)  # a growing segment with binlogs
    producer.insert(
        data.info.name, {"pk": [90_000], "vec": [QUERIES[0]], "n": [0], "tag": ["new"]}
    )  # log only
    queries = np.vstack([QUERIES[:1], data.vectors[-1][:5]])

    frame = Catalog(system).search(data.info.name, queries, k=1)

    assert frame["pk"].tolist() == [90_000, *range(50_000, 50_005)]  # each its own nearest
    assert frame["distance"].max() < 1e-3  # (float32 rounding of |q|^2 - 2 q.x + |x|^2)


def test_a_corrupt_index_file_is_searched_exactly_with_a_warning_and_rebuilt(
    system: System, data: Data
) -> None:
    indexed(system, data)
    [build] = [d.model for d in list_builds(system.store, data.info.id)][:1]
    system.storage.write_atomic(build.files[0], b"not a faiss index")

    with pytest.warns(IndexFallbackWarning, match=f"segment {build.segment_id}: index file {build.files[0]}"):
        frame = Catalog(system).search(data.info.name, QUERIES, k=K)

    assert recall(hits(frame), exact_neighbours(data, QUERIES, K)) >= 0.9
    assert [f["segment"] for f in frame.attrs["exact_segments"]] == [build.segment_id]
    assert_rebuilt_once(system, data, build)


def test_a_missing_index_file_is_searched_exactly_with_a_warning_and_rebuilt(
    system: System, data: Data
) -> None:
    indexed(system, data, "IVF_FLAT")
    build = list_builds(system.store, data.info.id)[1].model
    system.storage.delete(build.files[0])

    with pytest.warns(IndexFallbackWarning, match="is unusable"):
        frame = Catalog(system).search(data.info.name, QUERIES, k=K)

    assert recall(hits(frame), exact_neighbours(data, QUERIES, K)) >= 0.9
    assert_rebuilt_once(system, data, build)


def assert_rebuilt_once(system: System, data: Data, broken: SegmentIndex) -> None:
    """The broken build is re-issued and its segment's task queued, once (a second search
    queues nothing more); the scheduler's round rebuilds it and searches use it again."""
    [again] = [
        d.model for d in list_builds(system.store, data.info.id) if d.model.build_id == broken.build_id
    ]
    assert again.state is SegmentIndexState.UNISSUED
    queued = [d.model.segment_id for d in list_tasks(system.store, "index")]
    assert queued == [broken.segment_id]
    second = Catalog(system).search(data.info.name, QUERIES, k=K)  # the segment waits: exact, no warning
    assert second.attrs["exact_segments"] == [] and len(list_tasks(system.store, "index")) == 1

    TaskScheduler([IndexTasks()], system.settings).round(system, "local")

    [rebuilt] = [
        d.model for d in list_builds(system.store, data.info.id) if d.model.build_id == broken.build_id
    ]
    assert (rebuilt.state, rebuilt.version) == (SegmentIndexState.FINISHED, broken.version + 1)
    assert not list_tasks(system.store, "index")
    with warnings.catch_warnings():
        warnings.simplefilter("error", IndexFallbackWarning)
        frame = Catalog(system).search(data.info.name, QUERIES, k=K)
    assert frame.attrs["exact_segments"] == []
    assert recall(hits(frame), exact_neighbours(data, QUERIES, K)) >= 0.9


def test_a_filter_keeps_only_its_rows(system: System, data: Data) -> None:
    indexed(system, data, "IVF_FLAT")
    catalog = Catalog(system)
    fields = ["n", "tag"]  # n = pk % 7, tag = t{pk % 3}

    by_string = catalog.search(
        data.info.name, QUERIES, k=K, filter="n == 3 and tag != 't0'", output_fields=fields
    )
    expression = (pc.field("n") == 3) & (pc.field("tag") != "t0")
    by_expression = catalog.search(data.info.name, QUERIES, k=K, filter=expression, output_fields=fields)

    assert (
        len(by_string) == K * len(QUERIES)
        and (by_string["n"] == 3).all()
        and (by_string["tag"] != "t0").all()
    )
    assert hits(by_string) == hits(by_expression)
    pks, vectors = data.live()
    keep = (pks % 7 == 3) & (pks % 3 != 0)
    narrowed = Data(data.info, pks[keep].tolist(), [vectors[keep]])
    assert recall(hits(by_string), exact_neighbours(narrowed, QUERIES, K)) >= 0.9


def test_cosine_and_inner_product_rank_by_similarity(system: System, data: Data) -> None:
    indexed(system, data, "HNSW", "COSINE")
    pks, vectors = data.live()

    frame = Catalog(system).search(data.info.name, vectors[:3] * 5.0, k=2)  # scaled: same direction

    assert frame.groupby("query")["pk"].first().tolist() == pks[:3].tolist()
    assert frame.groupby("query")["distance"].first().to_numpy() == pytest.approx(1.0, abs=1e-4)
    assert (frame.groupby("query")["distance"].diff().dropna() <= 0).all(), "most similar first"


def test_a_search_at_a_time_sees_neither_later_rows_nor_later_deletes(
    system: System, producer: Producer, data: Data
) -> None:
    travel = System(replace(system.settings, time_travel=600.0), system.store, system.storage)
    indexed(travel, data)
    pks, vectors = data.live()
    victim, near = int(pks[0]), vectors[:1]
    far = {"pk": [91_001], "vec": [vectors[0] + 100.0], "n": [0], "tag": ["x"]}
    before = max(a.timestamp for a in producer.insert(data.info.name, far).values())
    producer.delete(data.info.name, [victim], partition="_default")
    twin = {"pk": [91_000], "vec": near, "n": [0], "tag": ["x"]}
    after = max(a.timestamp for a in producer.insert(data.info.name, twin).values())

    then = Catalog(travel).search(data.info.name, near, k=2, as_of=before)
    now = Catalog(travel).search(data.info.name, near, k=2, as_of=after)

    assert victim in set(then["pk"]) and 91_000 not in set(then["pk"])
    assert victim not in set(now["pk"]) and 91_000 in set(now["pk"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"vectors": np.zeros((2, DIM + 1))},
            f"query vectors have dimension {DIM + 1}, field 'vec' has {DIM}",
        ),
        (
            {"vectors": np.zeros((1, DIM - 4))},
            f"query vectors have dimension {DIM - 4}, field 'vec' has {DIM}",
        ),
        ({"vectors": np.zeros((2, 2, DIM))}, r"one vector or an \(n, 16\) array, got shape \(2, 2, 16\)"),
        ({"vectors": np.zeros((0, DIM))}, r"got shape \(0, 16\)"),
        ({"vectors": [["a"] * DIM]}, "query vectors must be an array of numbers"),
        ({"k": 0}, r"k must be an integer in \[1, 16384\], got 0"),
        ({"k": -3}, r"k must be an integer in \[1, 16384\], got -3"),
        ({"k": 2.5}, r"k must be an integer in \[1, 16384\], got 2.5"),
        ({"k": 16385}, r"k must be an integer in \[1, 16384\], got 16385"),
        ({"metric": "l3"}, "unknown metric 'l3': one of L2, IP, COSINE"),
        ({"field": "nope"}, r"no field 'nope' \(vector fields: vec\)"),
        ({"field": "n"}, "field 'n' is not a vector field"),
        ({"metric": "MANHATTAN"}, "unknown metric 'MANHATTAN': one of L2, IP, COSINE, HAMMING, JACCARD"),
        ({"metric": "IP"}, r"metric IP does not match the index 'vec' on 'vec' \(HNSW, L2\): search with L2"),
        ({"params": {"nprobe": 8}}, "HNSW takes ef as search parameters, not 'nprobe'"),
        ({"params": {"ef": 5}}, "ef=5 must be at least k=10"),
        ({"output_fields": ["vec"]}, "output field 'vec' is not a scalar field"),
        ({"filter": "no_such_column > 1"}, "filter 'no_such_column > 1' failed"),
        ({"vectors": [[np.nan] * DIM]}, "NaN or infinite"),
    ],
)
def test_requests_that_cannot_run_are_refused_naming_why(
    system: System, data: Data, kwargs: dict[str, object], message: str
) -> None:
    indexed(system, data)
    request: dict[str, object] = {"vectors": QUERIES[:2], "k": K, **kwargs}

    with pytest.raises(SearchError, match=message) as caught:
        Catalog(system).search(data.info.name, **request)  # type: ignore[arg-type]

    assert str(caught.value).startswith(f"cannot search {data.info.name!r}: ")


def test_search_params_without_an_index_are_refused(system: System, data: Data) -> None:
    with pytest.raises(
        SearchError, match=r"field 'vec' has no index: search parameters \['ef'\] do not apply"
    ):
        Catalog(system).search(data.info.name, QUERIES[:1], params={"ef": 64})


def test_cli_builds_with_wait_and_searches(system: System, settings: Settings, data: Data) -> None:
    built = subprocess.run(
        [str(VCHAN), "create-index", "--collection", data.info.name, "--field", "vec", "--type", "IVF_FLAT", "--wait", "--engine", "local"],
        env=cli_env(settings), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert "built 3 segments (4600 rows" in built.stdout and "failed 0" in built.stdout
    vector = ",".join(f"{x:.6f}" for x in QUERIES[0])

    run = subprocess.run(
        [str(VCHAN), "search", "--collection", data.info.name, "--vector", vector, "-k", "3", "--output-fields", "tag", "--json"],
        env=cli_env(settings), capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert {r["pk"] for r in rows} == exact_neighbours(data, QUERIES[:1], 3)[0]
    assert len(rows) == 3 and set(rows[0]) == {"query", "pk", "distance", "tag"}
    bad = subprocess.run(
        [str(VCHAN), "search", "--collection", data.info.name, "--vector", "1,2", "-k", "3"],
        env=cli_env(settings), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1 and f"query vectors have dimension 2, field 'vec' has {DIM}" in bad.stderr
