"""`vchan quarantine` of a damaged binlog of an indexed segment resets the segment's index
builds: a Finished build's file indexes rows the segment no longer holds, a build in flight
read them, a Failed one failed on the damaged file. Each is reset with the reason, the
segment's task queued once, and a search through the indexes agrees with the segments."""

from __future__ import annotations

import subprocess
import warnings
from dataclasses import replace
from pathlib import Path

from vchan_assets.catalog import Catalog
from vchan_assets.datacoord.tasks import TaskScheduler, list_tasks
from vchan_assets.indexes.meta import (
    BuiltFiles,
    create_index,
    finish_build,
    list_builds,
    reissue_build,
    start_build,
)
from vchan_assets.indexes.tasks import IndexTasks, rebuild_segment
from vchan_assets.model import SegmentIndex, SegmentIndexState, SegmentInfo, TaskState
from vchan_assets.query.search import IndexFallbackWarning
from vchan_assets.system import System
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.index_data import (
    Data,
    clustered,
    exact_neighbours,
    live_sorted,
    new_data,
    sorted_segments,
)
from vchan_assets.wal.producer import Producer

QUERIES = clustered(20, seed=321)
K = 10


def _build_of(system: System, seg: SegmentInfo) -> tuple[SegmentIndex, int]:
    [d] = [d for d in list_builds(system.store, seg.collection_id) if d.model.segment_id == seg.id]
    return d.model, d.kv.version


def _damage_vectors(system: System, seg: SegmentInfo) -> Path:
    """Truncate the segment's vector binlog (its only file of that group: a sorted segment)."""
    [log] = max(seg.binlogs, key=lambda g: g.group).logs
    path = Path(system.storage.path(log.path))
    path.write_bytes(path.read_bytes()[:100])
    return path


def _quarantine(system: System, path: Path) -> str:
    done = subprocess.run(
        [str(VCHAN), "quarantine", "--file", str(path), "--yes"],
        env=cli_env(system.settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_quarantining_a_binlog_resets_the_segments_index_builds_and_search_agrees_with_the_segments(
    system: System, producer: Producer
) -> None:
    data: Data = new_data(producer)
    sorted_segments(system, producer, data, [1500, 1300, 1200, 1100])
    finished, failing, in_flight, kept = sorted(live_sorted(system, data.info), key=lambda s: s.id)
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    damaged = _damage_vectors(system, failing)  # its build fails for good (one attempt)
    tasks = TaskScheduler([IndexTasks()], replace(system.settings, task_max_attempts=1))
    tasks.scan(system)
    tasks.round(system, "local")
    assert _build_of(system, finished)[0].files and _build_of(system, kept)[0].files
    assert _build_of(system, failing)[0].state is SegmentIndexState.FAILED
    assert [t.state for t in (d.model for d in list_tasks(system.store, "index"))] == [TaskState.FAILED]
    # A builder rebuilding `in_flight` (started: it holds its record's version) when it is quarantined.
    [d] = [d for d in list_builds(system.store, data.info.id) if d.model.segment_id == in_flight.id]
    again = reissue_build(system.store, d)
    assert again is not None
    builder = start_build(system.store, again, "elsewhere")
    assert builder is not None

    out = {seg.id: _quarantine(system, _damage_vectors(system, seg)) for seg in (finished, in_flight)}
    out[failing.id] = _quarantine(system, damaged)

    for seg in (finished, failing, in_flight):
        build, _ = _build_of(system, seg)
        assert f"index builds of segment {seg.id} reset" in out[seg.id]
        # No rows left (a sorted segment has one file per column group): nothing to build.
        assert (build.state, build.files, build.rows) == (SegmentIndexState.FINISHED, (), 0)
        assert "quarantined" in build.reissue_reason and "rows lost" in build.reissue_reason
    old = builder.model
    late = BuiltFiles((f"index_files/{old.build_id}/{old.version}/index.faiss",), 1, "faiss", 1)
    assert finish_build(system.store, builder, late) is None, "the build in flight commits nothing"
    queued = {d.model.segment_id: d.model for d in list_tasks(system.store, "index")}
    assert set(queued) == {finished.id, failing.id, in_flight.id}, "each segment's task queued once"
    assert {t.state for t in queued.values()} == {TaskState.QUEUED} and queued[failing.id].attempts == 0

    report = tasks.round(system, "local")
    assert not report.failed and not list_tasks(system.store), "nothing left to build: the tasks end"
    assert _build_of(system, kept)[0].files, "the untouched segment keeps its index"

    with Catalog(system) as catalog:
        for seg in (finished, failing, in_flight):
            assert catalog.read_segment(seg.id, as_arrow=True).num_rows == 0
        kept_pks = set(catalog.read_segment(kept.id, as_arrow=True)["pk"].to_pylist())
        data.deleted |= set(data.pks) - kept_pks  # what the quarantines lost, for the exact answer
        with warnings.catch_warnings():
            warnings.simplefilter("error", IndexFallbackWarning)  # through the index, no fallback
            frame = catalog.search(data.info.name, QUERIES, k=K)
    found = [set(frame.loc[frame["query"] == q, "pk"]) for q in range(len(QUERIES))]
    assert found == exact_neighbours(data, QUERIES, K)


def test_a_reset_build_of_a_segment_with_rows_left_goes_unissued_and_is_built_again_over_them(
    system: System, producer: Producer
) -> None:
    """The path of a segment that keeps rows after a quarantine (one of several files per
    column group lost): its builds wait Unissued, searched exactly meanwhile, and the
    queued task builds them again under a new version."""
    data: Data = new_data(producer)
    sorted_segments(system, producer, data, [1200])
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    tasks = TaskScheduler([IndexTasks()], system.settings)
    tasks.scan(system)
    tasks.round(system, "local")
    [seg] = live_sorted(system, data.info)
    first, _ = _build_of(system, seg)
    assert first.files and first.version == 1

    [reset] = rebuild_segment(system, seg, "rows of segment changed")

    assert (reset.state, reset.rows, reset.reissue_reason) == (
        SegmentIndexState.UNISSUED,
        1200,
        "rows of segment changed",
    )
    [task] = [d.model for d in list_tasks(system.store, "index")]
    assert task.state is TaskState.QUEUED and task.segment_id == seg.id
    assert rebuild_segment(system, seg, "again")[0].state is SegmentIndexState.UNISSUED
    assert len(list_tasks(system.store)) == 1, "queued once"
    with Catalog(system) as catalog, warnings.catch_warnings(record=True):
        frame = catalog.search(data.info.name, QUERIES, k=K)  # exactly: no Finished build
    assert [set(frame.loc[frame["query"] == q, "pk"]) for q in range(len(QUERIES))] == exact_neighbours(
        data, QUERIES, K
    )
    tasks.round(system, "local")
    again, _ = _build_of(system, seg)
    assert again.state is SegmentIndexState.FINISHED and again.version == 2 and again.files
    assert not list_tasks(system.store)
