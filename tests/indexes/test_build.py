"""Segment builds with faiss: only sorted segments, the file written before the one
transaction that makes the build Finished, in this process or as Spark tasks; a build that
cannot be made fails with its reason and leaves nothing visible."""

from __future__ import annotations

import faiss
import pytest

from vchan_assets.indexes.build import engine_version, load_index, waves
from vchan_assets.indexes.meta import (
    BuiltFiles,
    create_index,
    drop_index,
    finish_build,
    list_builds,
    start_build,
)
from vchan_assets.indexes.step import IndexBuilder, index_step
from vchan_assets.model import SegmentIndex, SegmentIndexState
from vchan_assets.system import System
from vchan_assets.testing.index_data import Data, live_sorted, sorted_segments
from vchan_assets.wal.producer import Producer


def builds(system: System, data: Data) -> list[SegmentIndex]:
    return sorted((d.model for d in list_builds(system.store, data.info.id)), key=lambda b: b.segment_id)


@pytest.mark.parametrize(
    ("kind", "metric", "params", "faiss_type", "faiss_metric"),
    [
        ("HNSW", "L2", {"M": 8, "efConstruction": 40}, faiss.IndexHNSWFlat, faiss.METRIC_L2),
        ("IVF_FLAT", "IP", {"nlist": 16}, faiss.IndexIVFFlat, faiss.METRIC_INNER_PRODUCT),
        ("IVF_PQ", "COSINE", {"m": 4}, faiss.IndexIVFPQ, faiss.METRIC_INNER_PRODUCT),
    ],
)
def test_a_build_writes_its_index_file_then_marks_it_finished(
    system: System,
    producer: Producer,
    data: Data,
    kind: str,
    metric: str,
    params: dict[str, object],
    faiss_type: type,
    faiss_metric: int,
) -> None:
    sorted_segments(system, producer, data, [1500])
    create_index(system.store, data.info, "vec", kind, metric, params)

    report = IndexBuilder(system, "local").run()

    [build] = builds(system, data)
    assert report.finished == [build.build_id] and report.rows == 1500 and not report.failed
    assert build.state is SegmentIndexState.FINISHED and build.version == 1
    assert build.files == (f"index_files/{build.build_id}/1/index.faiss",)
    blob = system.storage.read_bytes(build.files[0])
    assert (
        build.serialized_size == len(blob)
        and build.engine_version == engine_version() == f"faiss-{faiss.__version__}"
    )
    loaded = load_index(blob)  # (deserialized as its own class)
    assert isinstance(loaded, faiss_type) and loaded.ntotal == 1500 and loaded.metric_type == faiss_metric


def test_builds_run_as_spark_tasks(system: System, producer: Producer, data: Data) -> None:
    sorted_segments(system, producer, data, [1100, 1200])
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2")

    report = IndexBuilder(system, "spark").run()

    done = builds(system, data)
    assert sorted(report.finished) == sorted(b.build_id for b in done) and len(done) == 2
    assert all(b.state is SegmentIndexState.FINISHED and b.node.endswith("/spark") for b in done)
    assert sorted(load_index(system.storage.read_bytes(b.files[0])).ntotal for b in done) == [1100, 1200]


def test_a_build_whose_vectors_are_unreadable_fails_with_the_reason(
    system: System, producer: Producer, data: Data
) -> None:
    sorted_segments(system, producer, data, [1500])
    [seg] = live_sorted(system, data.info)
    vector_log = next(g for g in seg.binlogs if g.group != 0).logs[0].path
    system.storage.delete(vector_log)
    create_index(system.store, data.info, "vec", "HNSW", "L2")

    report = IndexBuilder(system, "local").run()

    [build] = builds(system, data)
    assert build.state is SegmentIndexState.FAILED and build.files == ()
    assert "vectors unreadable" in build.fail_reason and vector_log in build.fail_reason
    assert report.failed == [(build.build_id, build.fail_reason)]
    assert system.storage.list_files("index_files/") == []


def test_a_builder_whose_build_was_started_again_commits_nothing(
    system: System, producer: Producer, data: Data
) -> None:
    sorted_segments(system, producer, data, [1500])
    create_index(system.store, data.info, "vec", "HNSW", "L2")
    [unissued] = list_builds(system.store, data.info.id)
    first = start_build(system.store, unissued, "node-a")
    assert first is not None and start_build(system.store, unissued, "node-b") is None  # one start wins
    # the first builder is taken for dead: its build is started again (version 2)
    restarted = start_build(system.store, first, "node-b")
    assert restarted is not None and restarted.model.version == 2

    late = finish_build(system.store, first, BuiltFiles(("index_files/x/1/index.faiss",), 10, "faiss", 1))

    assert late is None
    [build] = builds(system, data)
    assert build.state is SegmentIndexState.IN_PROGRESS and build.node == "node-b" and build.files == ()


def test_builds_of_a_dropped_index_do_not_start(system: System, producer: Producer, data: Data) -> None:
    sorted_segments(system, producer, data, [1500])
    create_index(system.store, data.info, "vec", "HNSW", "L2")
    drop_index(system.store, data.info, field="vec")

    report = IndexBuilder(system, "local").run()

    assert report.finished == [] and [b.state for b in builds(system, data)] == [SegmentIndexState.UNISSUED]


def test_the_index_step_builds_segments_sorted_after_the_index_was_created(
    system: System, producer: Producer, data: Data
) -> None:
    create_index(system.store, data.info, "vec", "HNSW", "IP")
    sorted_segments(system, producer, data, [1200, 500])  # flushed and sorted after CreateIndex

    report = index_step(system, engine="local")

    done = builds(system, data)
    assert {b.segment_id for b in done} == {s.id for s in live_sorted(system, data.info)}
    assert all(b.state is SegmentIndexState.FINISHED for b in done)
    assert len(report.created) == 2 and len(report.finished) == 1  # the 500-row one needs no files
    assert index_step(system, engine="local").created == []


@pytest.mark.parametrize(
    ("count", "cores", "expected"),
    [
        (1, 2, [(range(0, 1), 2)]),  # a lone build gets every core
        (2, 2, [(range(0, 2), 1)]),
        (3, 2, [(range(0, 2), 1), (range(2, 3), 2)]),  # the third does not run on one core of two
        (10, 2, [(range(0, 10), 1)]),
        (5, 4, [(range(0, 4), 1), (range(4, 5), 4)]),
        (7, 4, [(range(0, 4), 1), (range(4, 7), 1)]),  # 3 left on 4 cores: one thread each
        (2, 8, [(range(0, 2), 4)]),
        (0, 2, []),
    ],
)
def test_builds_fill_every_core_and_a_tail_that_would_not_splits_them(
    count: int, cores: int, expected: list[tuple[range, int]]
) -> None:
    assert waves(count, cores) == expected
