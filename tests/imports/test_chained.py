"""A job of more segments than one etcd transaction holds (128 operations): its register
and its commit are chained over transactions of at most CHUNK_SEGMENTS segments, each
recording the job's progress, so the job completes, and a restart after a crash in the
middle of either chain goes on from where it stopped: every row once, no segment twice."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord import segment_ops
from vchan_assets.datacoord.recovery import list_orphans
from vchan_assets.imports.executor import CHUNK_SEGMENTS, MANIFEST_ROOT
from vchan_assets.imports.jobs import ImportState, get_job
from vchan_assets.imports.step import import_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentState
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, segments
from vchan_assets.testing.import_files import (
    assert_imported_once,
    collect_garbage,
    rows,
    run_import,
    vchan_import,
    visible,
    write_parquet,
)
from vchan_assets.testing.steps import assert_channel_index_complete, new_collection
from vchan_assets.wal.producer import Producer

ROWS = 300  # two rows a segment: 150 segments, more than one transaction's 128 operations


def two_rows_a_segment(settings: Settings) -> Settings:
    return replace(settings, segment_max_size_mb=2.5 * SCHEMA.row_bytes() / 2**20)


def assert_each_segment_once(store: MetaStore, info: CollectionInfo, segment_ids: tuple[int, ...]) -> None:
    found = segments(store, info)
    assert len(segment_ids) == len(set(segment_ids)) > CHUNK_SEGMENTS
    assert sorted(s.id for s in found) == sorted(segment_ids), "no segment twice, none lost"
    assert {s.state for s in found} == {SegmentState.FLUSHED}
    assert_channel_index_complete(store)  # every registered segment with its vchannel's index entry


def test_a_job_of_more_segments_than_one_transaction_holds_completes_with_every_row_once(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    data = rows(ROWS, seed=3)

    job = run_import(store, two_rows_a_segment(settings), info, [write_parquet(tmp_path / "a.parquet", data)])

    assert job.state is ImportState.COMPLETED, job.reason
    assert job.imported_rows == ROWS and job.committed == job.registered == len(job.segment_ids) > 128
    assert_each_segment_once(store, info, job.segment_ids)
    assert_imported_once(visible(system, info), data)
    assert not system.storage.exists(job.manifest), "the manifest goes once every segment is registered"


@pytest.mark.parametrize("step", ["import_mid_register", "import_mid_commit"])
def test_a_chained_job_killed_mid_chain_then_restarted_imports_exactly_once(
    system: System, step: str, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    small = two_rows_a_segment(settings)
    info = new_collection(producer)
    data = rows(ROWS, seed=4)
    args = ["--collection", info.name, "--job-id", "81", write_parquet(tmp_path / "a.parquet", data)]

    crashed = vchan_import(small, *args, VCHAN_FAILPOINT=step)

    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    job = get_job(store, 81).model
    assert job.state is ImportState.IMPORTING and len(job.segment_ids) > CHUNK_SEGMENTS
    if step == "import_mid_register":
        assert job.registered == CHUNK_SEGMENTS and job.committed == 0
        assert visible(system, info).num_rows == 0, "nothing visible before the commit"
        collect_garbage(store, system.storage, small)  # the files of the segments not registered stay
    else:
        assert job.registered == len(job.segment_ids) and job.committed == CHUNK_SEGMENTS
        assert 0 < visible(system, info).num_rows < ROWS, "a chained commit is visible chunk by chunk"

    report = import_step(System(replace(small, import_timeout=0.001), store, system.storage), engine="local")

    assert report.resumed == [81] and report.completed == [81]
    done = get_job(store, 81).model
    assert done.state is ImportState.COMPLETED and done.segment_ids == job.segment_ids
    assert_each_segment_once(store, info, done.segment_ids)
    assert_imported_once(visible(system, info), data)
    collect_garbage(store, system.storage, small)
    assert not list_orphans(store, system.storage)
    assert_imported_once(visible(system, info), data)


def test_a_chained_commit_that_fails_midway_keeps_the_committed_chunks_and_drops_the_rest(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    small = two_rows_a_segment(settings)
    info = new_collection(producer)
    path = write_parquet(tmp_path / "a.parquet", rows(ROWS, seed=5))
    crashed = vchan_import(
        small, "--collection", info.name, "--job-id", "82", path, VCHAN_FAILPOINT="import_mid_commit"
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    first = get_job(store, 82).model
    # a segment of the chunk the restarted commit takes next, dropped (e.g. by an operator)
    next_chunk = first.segment_ids[CHUNK_SEGMENTS]
    taken = store.get_model(store.keys.segment(info.id, first.partition_id, next_chunk), SegmentInfo)
    assert taken is not None
    store.cas(taken.kv.key, taken.kv.version, segment_ops.drop(taken.model))
    seen = visible(system, info).num_rows

    report = import_step(System(replace(small, import_timeout=0.001), store, system.storage), engine="local")

    job = get_job(store, 82).model
    assert report.failed == [82] and job.state is ImportState.FAILED
    assert job.reason == f"segment {next_chunk} of the job is Dropped, not Importing"
    states = {s.id: s.state for s in segments(store, info)}
    assert {states[i] for i in job.segment_ids[:CHUNK_SEGMENTS]} == {SegmentState.FLUSHED}
    assert {states[i] for i in job.segment_ids[CHUNK_SEGMENTS:]} == {SegmentState.DROPPED}
    assert visible(system, info).num_rows == seen > 0, "the committed chunk stays visible"


def test_a_chained_failure_killed_midway_is_finished_by_the_next_executor_with_its_reason(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    small = two_rows_a_segment(settings)
    info = new_collection(producer)
    args = ["--collection", info.name, "--job-id", "83", write_parquet(tmp_path / "a.parquet", rows(ROWS))]
    crashed = vchan_import(small, *args, VCHAN_FAILPOINT="import_before_commit")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    job = get_job(store, 83).model
    first = store.get_model(store.keys.segment(info.id, job.partition_id, job.segment_ids[0]), SegmentInfo)
    assert first is not None
    store.cas(first.kv.key, first.kv.version, segment_ops.drop(first.model))  # the commit's first chunk fails

    failing = vchan_import(small, *args, VCHAN_FAILPOINT="import_mid_fail")

    assert failing.returncode == -signal.SIGKILL, failing.stderr
    half = get_job(store, 83).model
    reason = f"segment {job.segment_ids[0]} of the job is Dropped, not Importing"
    assert half.state is ImportState.IMPORTING and half.reason == reason
    assert {s.state for s in segments(store, info)} == {SegmentState.DROPPED, SegmentState.IMPORTING}

    report = import_step(System(replace(small, import_timeout=0.001), store, system.storage), engine="local")

    done = get_job(store, 83).model
    assert report.failed == [83] and done.state is ImportState.FAILED and done.reason == reason
    assert {s.state for s in segments(store, info)} == {SegmentState.DROPPED}
    assert visible(system, info).num_rows == 0


def test_a_chained_job_past_its_retention_takes_the_manifests_of_its_attempts_with_it(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    job = run_import(
        store, two_rows_a_segment(settings), info, [write_parquet(tmp_path / "a.parquet", rows(ROWS))]
    )
    left = f"{MANIFEST_ROOT}/{job.job_id}/0.json"  # as by an attempt killed before the job named it
    system.storage.write_atomic(left, b"{}")

    report = import_step(system, engine="local", now=job.finished_at + settings.import_job_retention + 1)

    assert report.deleted == [job.job_id]
    assert not system.storage.exists(left) and not system.storage.exists(job.manifest)
