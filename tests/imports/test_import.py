"""Bulk import end to end: Parquet files into Flushed segments in the binlog layout,
readable like any other rows; the job's meta; the same job id imports once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from vchan_assets import imports
from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.imports.executor import ImportExecutor
from vchan_assets.imports.jobs import ImportJobConflictError, ImportJobNotFoundError, ImportState, get_job
from vchan_assets.imports.step import import_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.import_files import assert_imported_once, rows, visible, write_parquet
from vchan_assets.testing.steps import new_collection, sync_all
from vchan_assets.wal.producer import Producer


def test_parquet_files_become_flushed_segments_readable_by_read_collection(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    a, b = rows(300, 0, seed=1), rows(200, 1000, seed=2)
    paths = [write_parquet(tmp_path / "in" / "a.parquet", a), write_parquet(tmp_path / "in" / "b.parquet", b)]

    job_id = imports.submit(info.name, paths, store=store, settings=settings)
    job = imports.run(job_id, engine="local", store=store, settings=settings)

    assert job.state is ImportState.COMPLETED, job.reason
    assert (job.rows, job.imported_rows, job.progress) == (500, 500, 100)
    assert [f.rows for f in job.files] == [300, 200]
    assert_imported_once(visible(system, info), pa.concat_tables([a, b]))
    segs = [s for s in segments(store, info) if s.id in job.segment_ids]
    assert {s.state for s in segs} == {SegmentState.FLUSHED}
    assert {s.vchannel for s in segs} == set(info.vchannels)  # routed by pk % K, as the producer
    for s in segs:
        k = info.vchannels.index(s.vchannel)
        pks = Catalog(system).read_segment(s.id)["pk"]
        assert (pks % len(info.vchannels) == k).all()
        assert len(s.binlogs) == 2 and s.statslogs and s.import_job == job_id
        assert all(b.ts_from == job.timestamp for b in s.binlog_files)


def test_a_directory_stands_for_its_files(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer, channels=1)
    write_parquet(tmp_path / "dir" / "one.parquet", rows(50, 0))
    write_parquet(tmp_path / "dir" / "sub" / "two.parquet", rows(70, 100))
    (tmp_path / "dir" / "notes.txt").write_text("not data")

    job_id = imports.submit(info.name, [str(tmp_path / "dir")], store=store, settings=settings)
    job = imports.run(job_id, engine="local", store=store, settings=settings)

    assert job.state is ImportState.COMPLETED, job.reason
    assert len(job.files) == 2 and visible(system, info).num_rows == 120


def test_the_same_job_id_submitted_twice_imports_once(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    data = rows(100)
    path = write_parquet(tmp_path / "a.parquet", data)

    first = imports.submit(info.name, [path], job_id=4242, store=store, settings=settings)
    imports.run(first, engine="local", store=store, settings=settings)
    again = imports.submit(info.name, [path], job_id=4242, store=store, settings=settings)
    imports.run(again, engine="local", store=store, settings=settings)

    assert first == again == 4242
    assert_imported_once(visible(system, info), data)
    with pytest.raises(ImportJobConflictError, match="4242"):
        imports.submit(info.name, [path, path], job_id=4242, store=store, settings=settings)


def test_a_large_parquet_file_is_cut_into_segments_by_row_groups(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    from dataclasses import replace

    info = new_collection(producer, channels=1)
    small = replace(settings, segment_max_size_mb=30_000 * info.schema.row_bytes() / (1 << 20) / 1000)
    data = rows(120)
    path = write_parquet(tmp_path / "big.parquet", data, row_group_size=10)

    job_id = imports.submit(info.name, [path], store=store, settings=small)
    job = imports.run(job_id, engine="local", store=store, settings=small)

    assert job.state is ImportState.COMPLETED, job.reason
    assert len(job.segment_ids) >= 4  # max 30 rows per segment
    assert_imported_once(visible(system, info), data)


def test_import_on_spark_matches_the_files_and_the_catalog_lists_the_job(
    system: System, store: MetaStore, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    parts = [rows(150, i * 1000, seed=i) for i in range(3)]
    paths = [write_parquet(tmp_path / f"p{i}.parquet", t) for i, t in enumerate(parts)]

    job_id = imports.submit(info.name, paths, store=store, settings=settings)
    job = imports.run(job_id, engine="spark", store=store, settings=settings)

    assert job.state is ImportState.COMPLETED, job.reason
    assert_imported_once(visible(system, info), pa.concat_tables(parts))
    listed = Catalog(system).imports(info.name)
    row = listed.set_index("job_id").loc[job_id]
    assert (row["state"], row["rows"], row["imported_rows"], row["files"]) == ("Completed", 450, 450, 3)
    assert get_job(store, job_id).model.segment_ids == tuple(row["segments"])


def test_import_tasks_on_spark_are_admitted_by_memory_in_jobs_that_fit_the_budget(
    system: System, store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    parts = [rows(100, i * 1000, seed=i) for i in range(3)]
    paths = [write_parquet(tmp_path / f"p{i}.parquet", t) for i, t in enumerate(parts)]
    # A task's estimate is twice its buffer (2 MiB here): two tasks fit in 5 MiB.
    tight = replace(settings, import_buffer_mb=1.0, task_memory_mb=5.0)
    job_id = imports.submit(info.name, paths, store=store, settings=tight)
    executor = ImportExecutor(System(tight, store, storage), "spark")

    job = executor.run(job_id)

    assert job.state is ImportState.COMPLETED, job.reason
    assert executor.jobs == [[0, 1], [2]]
    assert_imported_once(visible(system, info), pa.concat_tables(parts))


def test_an_upsert_replaces_rows_already_in_the_collection_and_keeps_the_rest(
    system: System, store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    from vchan_assets.imports.checks import check_no_existing_pks

    info = new_collection(producer)
    old = rows(50, 0, seed=1)
    first = imports.submit(
        info.name, [write_parquet(tmp_path / "old.parquet", old)], store=store, settings=settings
    )
    imports.run(first, engine="local", store=store, settings=settings)
    new = rows(50, 40, seed=2)  # pks 40..89: 40..49 already there, with other values
    path = write_parquet(tmp_path / "new.parquet", new)

    plain = imports.submit(info.name, [path], store=store, settings=settings)
    upsert = imports.submit(info.name, [path], upsert=True, store=store, settings=settings)
    job = imports.run(upsert, engine="local", store=store, settings=settings)

    assert job.state is ImportState.COMPLETED and job.imported_rows == 50, job.reason
    expected = pa.concat_tables([old.slice(0, 40), new])
    assert_imported_once(visible(system, info), expected)
    assert check_no_existing_pks(store, storage, job).passed
    l0 = [s for s in segments(store, info) if s.id in job.segment_ids and s.level.value == "L0"]
    assert len(l0) == 1 and l0[0].num_rows == 50 and l0[0].state is SegmentState.FLUSHED
    # The same rows without upsert: the check reports the repeated pks.
    plain_job = imports.run(plain, engine="local", store=store, settings=settings)
    outcome = check_no_existing_pks(store, storage, plain_job)
    assert not outcome.passed and outcome.metadata["overlap"] == 50


def test_imported_segments_are_sorted_by_the_lifecycle_and_leave_the_log_checks_alone(
    system: System, store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    from vchan_assets.datanode.checks import check_log_rows
    from vchan_assets.lifecycle.step import lifecycle_step

    info = new_collection(producer)
    produced = rows(100, 0, seed=3)
    producer.insert(info.name, produced)
    producer.flush(info.name)
    sync_all(system, info)
    data = rows(300, 10_000, seed=4).take(pa.array(range(299, -1, -1)))  # pks descending
    job = imports.run(
        imports.submit(info.name, [write_parquet(tmp_path / "a.parquet", data)], store=store, settings=settings),
        engine="local", store=store, settings=settings,
    )  # fmt: skip

    for vchannel in info.vchannels:
        assert check_log_rows(store, storage, info, vchannel).passed
    lifecycle_step(system, engine="local", collect=False)

    live = [s for s in segments(store, info) if s.state is SegmentState.FLUSHED and s.level.value == "L1"]
    assert all(s.is_sorted for s in live)
    assert {i for s in live for i in s.compaction_from} >= set(job.segment_ids)
    for vchannel in info.vchannels:  # imported rows merged with synced ones are still told apart
        outcome = check_log_rows(store, storage, info, vchannel)
        assert outcome.passed, outcome.description
    assert_imported_once(visible(system, info), pa.concat_tables([produced, data]))


def test_progress_moves_with_the_finished_tasks_and_is_written_to_the_job(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer)
    paths = [write_parquet(tmp_path / f"{i}.parquet", rows(20, i * 100)) for i in range(3)]
    seen: list[tuple[str, int]] = []

    def record(job: imports.ImportJob) -> None:
        stored = get_job(store, job.job_id).model
        seen.append((stored.state.value, stored.progress))

    job_id = imports.submit(info.name, paths, store=store, settings=settings)
    imports.run(job_id, engine="local", on_progress=record, store=store, settings=settings)

    importing = [p for state, p in seen if state == "Importing"]
    assert {36, 63, 90} <= set(importing) and importing == sorted(importing)
    assert seen[-1] == ("Completed", 100)


def test_a_finished_job_is_deleted_by_the_import_step_after_the_retention_and_kept_before(
    store: MetaStore, storage: Storage, settings: Settings, producer: Producer, tmp_path: Path
) -> None:
    info = new_collection(producer, channels=1)
    path = write_parquet(tmp_path / "a.parquet", rows(20, 0))
    job_id = imports.submit(info.name, [str(path)], store=store, settings=settings)
    job = imports.run(job_id, engine="local", store=store, settings=settings)
    assert job.state is ImportState.COMPLETED
    system = System(replace(settings, import_job_retention=60.0), store, storage)
    assert import_step(system, engine="local", now=job.finished_at + 59).deleted == []
    assert get_job(store, job_id).model.state is ImportState.COMPLETED
    assert import_step(system, engine="local", now=job.finished_at + 61).deleted == [job_id]
    with pytest.raises(ImportJobNotFoundError):
        get_job(store, job_id)
    assert visible(system, info).num_rows == 20, "its rows stay"
