"""The task scheduler in a real `vchan datacoord` process: it sorts the flushed segments,
builds their indexes (the sort's commit pushes them), and a DataCoord SIGKILLed with
builds in flight leaves its tasks in etcd for the next one, which finishes them."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from lifecycle.helpers import start_datacoord

from indexes.helpers import Data, flushed_segments, new_collection
from vchan_assets.datacoord.tasks import list_tasks
from vchan_assets.indexes.gc import collect_indexes
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.model import SegmentIndex, SegmentIndexState, TaskState
from vchan_assets.storage.layout import INDEX_FILES
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

QUIET = {
    "VCHAN_LIFECYCLE_INTERVAL": "3600",
    "VCHAN_SORT_SCAN_INTERVAL": "3600",
    "VCHAN_COMPACTION_CHECK_INTERVAL": "3600",
}


def builds(system: System, data: Data) -> list[SegmentIndex]:
    return sorted((d.model for d in list_builds(system.store, data.info.id)), key=lambda b: b.build_id)


def test_a_datacoord_killed_with_builds_in_flight_leaves_them_to_the_next_one(
    system: System, producer: Producer, tmp_path: Path
) -> None:
    data = new_collection(producer)
    flushed_segments(system, producer, data, [1500, 1300])
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    marker = tmp_path / "failpoint"
    first = start_datacoord(
        system.settings, VCHAN_FAILPOINT="index_after_files=kill", VCHAN_FAILPOINT_MARKER=str(marker), **QUIET
    )
    try:
        assert first.wait(60) == -signal.SIGKILL, "killed with its builds' files written, not committed"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert marker.read_text().startswith("index_after_files")
    killed = builds(system, data)
    assert len(killed) == 2 and {b.state for b in killed} == {SegmentIndexState.IN_PROGRESS}
    in_flight = [d.model for d in list_tasks(system.store, "index")]
    assert len(in_flight) == 2 and {t.state for t in in_flight} == {TaskState.IN_PROGRESS}
    assert not list_tasks(system.store, "sort"), "the sorts were done before the builds"

    second = start_datacoord(system.settings, **QUIET)
    try:
        deadline = time.monotonic() + 60
        while {b.state for b in builds(system, data)} != {SegmentIndexState.FINISHED} or list_tasks(
            system.store
        ):
            assert second.poll() is None, second.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, f"not finished: {builds(system, data)}"
            time.sleep(0.2)
    finally:
        second.terminate()
        second.wait(30)
    done = builds(system, data)
    assert [b.version for b in done] == [2, 2], "started again by the second DataCoord"
    assert all(b.files and system.storage.exists(b.files[0]) for b in done)

    # The killed builder's files (version 1) are superseded: index GC deletes them.
    old = [f"{INDEX_FILES}/{b.build_id}/1/index.faiss" for b in done]
    assert all(system.storage.exists(k) for k in old)
    report = GarbageCollector(system, clock=lambda: time.time() + 2 * 86400, passes=[collect_indexes]).run()
    assert sorted(report.index_files) == sorted(old) and not report.index_builds
    assert all(system.storage.exists(b.files[0]) for b in done)
