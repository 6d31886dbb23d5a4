"""The `segment_indexes` asset: a vchannel's sorted segments indexed through Spark Connect
by Dagster's `materialize` on an ephemeral instance, against a real etcd and real files,
its sensor, and each of its three checks failing when what it checks is broken."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import dagster as dg
import faiss
import numpy as np
import pyarrow as pa
import pytest

from vchan_assets.cli.indexes import describe_index
from vchan_assets.cli.lifecycle import tasks as vchan_tasks
from vchan_assets.config import Settings
from vchan_assets.datacoord.tasks import TaskScheduler, list_tasks
from vchan_assets.defs.indexes.assets import index_sensor, segment_indexes
from vchan_assets.defs.resources import VchanResource
from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.tasks import IndexTasks
from vchan_assets.lifecycle.sort_tasks import SortTasks
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentIndex, SegmentIndexState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.index_data import (
    DIM,
    Data,
    flushed_segments,
    live_sorted,
    new_data,
    sorted_segments,
    vectors_lost,
)
from vchan_assets.wal.producer import Producer

from .helpers import evaluate

HNSW = {"M": 8, "efConstruction": 40}


@pytest.fixture
def system(dsettings: Settings, store: MetaStore) -> System:
    return System(dsettings, store, Storage.from_settings(dsettings))


@pytest.fixture
def data(producer: Producer, instance: dg.DagsterInstance) -> Data:
    found = new_data(producer)
    instance.add_dynamic_partitions("vchannels", list(found.info.vchannels))
    return found


def materialize(instance: dg.DagsterInstance, vchan: VchanResource, data: Data) -> dg.ExecuteInMemoryResult:
    [vchannel] = data.info.vchannels
    result = dg.materialize(
        [segment_indexes], instance=instance, resources={"vchan": vchan}, partition_key=vchannel
    )
    assert result.success
    return result


def checks(result: dg.ExecuteInMemoryResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {c.check_name: c for c in result.get_asset_check_evaluations()}


def builds(system: System, data: Data) -> dict[int, SegmentIndex]:
    return {d.model.segment_id: d.model for d in list_builds(system.store, data.info.id)}


def mine(sensor_result: dg.SensorResult, data: Data) -> list[str]:
    return [
        r.partition_key or ""
        for r in sensor_result.run_requests or []
        if r.partition_key in data.info.vchannels
    ]


def test_segment_indexes_builds_the_sorted_segments_the_sensor_finds_with_passing_checks(
    instance: dg.DagsterInstance, vchan: VchanResource, system: System, producer: Producer, data: Data
) -> None:
    create_index(system.store, data.info, "vec", "HNSW", "L2", HNSW)  # before any segment is sorted
    assert mine(evaluate(index_sensor, instance, vchan), data) == []
    sorted_segments(system, producer, data, [1100, 1300, 400])  # the last one too small for an index
    assert mine(evaluate(index_sensor, instance, vchan), data) == list(data.info.vchannels)

    result = materialize(instance, vchan, data)

    [materialization] = result.asset_materializations_for_node("segment_indexes")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["created"] == 3 and meta["finished"] == 2 and meta["failed"] == 0
    assert meta["rows_indexed"] == 2400 and meta["built"] == 2 and meta["segments"] == 3
    found = checks(result)
    assert sorted(found) == ["builds_finished", "index_recall", "index_rows"]
    assert all(c.passed for c in found.values()), [c.description for c in found.values()]
    assert found["index_recall"].metadata["recall_min"].value >= 0.9
    done = builds(system, data)
    assert all(b.state is SegmentIndexState.FINISHED for b in done.values()) and len(done) == 3
    assert all(b.node.endswith("/spark") for b in done.values() if b.files)
    assert mine(evaluate(index_sensor, instance, vchan), data) == []  # nothing left to build


def test_each_check_of_segment_indexes_fails_when_what_it_checks_is_broken(
    instance: dg.DagsterInstance, vchan: VchanResource, system: System, producer: Producer, data: Data
) -> None:
    sorted_segments(system, producer, data, [1100, 1200])
    create_index(system.store, data.info, "vec", "HNSW", "L2", HNSW)
    assert all(c.passed for c in checks(materialize(instance, vchan, data)).values())
    first, second = sorted(live_sorted(system, data.info), key=lambda s: s.id)
    done = builds(system, data)
    rng = np.random.default_rng(7)
    # the first segment's file: an index of as many rows, of other vectors (a bad index)
    write_index(system, done[first.id].files[0], rng.normal(0, 10, (first.num_rows, DIM)))
    # the second's: an index of fewer rows than its segment (a build Finished with the wrong count)
    write_index(system, done[second.id].files[0], rng.normal(0, 10, (second.num_rows - 100, DIM)))
    # a third segment whose vectors cannot be read: its build fails
    sorted_segments(system, producer, data, [1050])
    [third] = [s for s in live_sorted(system, data.info) if s.id not in (first.id, second.id)]
    system.storage.delete(next(g for g in third.binlogs if g.group != 0).logs[0].path)

    found = checks(materialize(instance, vchan, data))

    assert not found["builds_finished"].passed
    assert f"segment {third.id}: build" in (found["builds_finished"].description or "")
    assert "vectors unreadable" in (found["builds_finished"].description or "")
    rows = found["index_rows"].description or ""
    assert (
        not found["index_rows"].passed
        and f"segment {second.id}:" in rows
        and f"segment {first.id}:" not in rows
    )
    recall = found["index_recall"].description or ""
    assert not found["index_recall"].passed and f"segment {first.id} " in recall


def write_index(system: System, key: str, vectors: np.ndarray) -> None:
    index = faiss.IndexHNSWFlat(DIM, 8)
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    system.storage.write_atomic(key, pa.py_buffer(faiss.serialize_index(index)))


def vchan_says(capsys: pytest.CaptureFixture[str], settings: Settings, data: Data) -> tuple[str, dict]:
    """What `vchan tasks --kind index` and `vchan describe-index --json` print of the
    collection (the CLI's functions, on `settings`)."""
    listed = argparse.Namespace(retry=False, kind="index", collection=data.info.name)
    assert vchan_tasks(listed, settings) == 0
    tasks_out = capsys.readouterr().out
    described = argparse.Namespace(collection=data.info.name, json=True)
    assert describe_index(described, settings) == 0
    [progress] = json.loads(capsys.readouterr().out)
    return tasks_out, progress


def test_a_build_run_by_the_asset_goes_through_its_index_task_as_a_datacoords_build_does(
    instance: dg.DagsterInstance,
    dsettings: Settings,
    system: System,
    producer: Producer,
    data: Data,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`segment_indexes` builds through the DataCoord's index tasks: a build that fails
    leaves its task backing off with its attempt and reason (`vchan tasks`; the build's
    reason in `vchan describe-index`), the sensor asks nothing for it until the backoff
    passed, and once built its task is gone; `vchan tasks` and `vchan describe-index` then
    say of it what they say of a build the DataCoord's scheduler ran."""
    vchan = VchanResource.from_settings(replace(dsettings, task_retry_backoff=600.0))
    sorted_segments(system, producer, data, [1100])
    create_index(system.store, data.info, "vec", "HNSW", "L2", HNSW)
    [seg] = live_sorted(system, data.info)
    saved = vectors_lost(system, data, seg)

    [failed] = materialize(instance, vchan, data).asset_materializations_for_node("segment_indexes")
    meta = {k: v.value for k, v in failed.metadata.items()}
    assert (meta["failed"], meta["task_attempts_failed"], meta["tasks_backing_off"]) == (1, 1, 1)
    tasks_out, progress = vchan_says(capsys, dsettings, data)
    assert (
        f"index of segment {seg.id} (collection {data.info.id}): Queued, attempts 1, next try in" in tasks_out
    )
    assert "vectors unreadable" in tasks_out
    assert progress["failed"] == 1 and "vectors unreadable" in progress["fail_reasons"][str(seg.id)]
    assert mine(evaluate(index_sensor, instance, vchan), data) == [], "no run while it backs off"
    [waited] = materialize(instance, vchan, data).asset_materializations_for_node("segment_indexes")
    assert waited.metadata["task_attempts"].value == 0

    for path, blob in saved.items():
        system.storage.write_atomic(path, blob)
    [d] = list_tasks(system.store, "index")
    system.store.cas(d.kv.key, d.kv.version, replace(d.model, not_before=time.time() - 1.0))  # backoff over
    assert mine(evaluate(index_sensor, instance, vchan), data) == list(data.info.vchannels)
    [built] = materialize(instance, vchan, data).asset_materializations_for_node("segment_indexes")
    assert (built.metadata["finished"].value, built.metadata["task_attempts"].value) == (1, 1)
    by_dagster = vchan_says(capsys, dsettings, data)
    assert by_dagster[0] == f"no tasks of {data.info.name}\n", "a done task is deleted"
    assert (by_dagster[1]["finished"], by_dagster[1]["failed"]) == (1, 0)

    # The DataCoord's scheduler builds a second segment: the CLI says the same of both.
    flushed_segments(system, producer, data, [1200])
    scheduler = TaskScheduler([SortTasks(), IndexTasks()], system.settings)
    scheduler.scan(system)
    assert [kind for kind, _ in scheduler.round(system, "local").done] == ["sort", "index"]
    tasks_out, progress = vchan_says(capsys, dsettings, data)
    assert tasks_out == by_dagster[0]
    assert (progress["finished"], progress["failed"], progress["pending"]) == (2, 0, 0)
    assert progress["indexed_rows"] == progress["total_rows"] == 2300
    assert all(b.state is SegmentIndexState.FINISHED and b.files for b in builds(system, data).values())
