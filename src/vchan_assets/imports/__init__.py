"""Bulk import: files straight into flushed segments, as a job that survives crashes.

    from vchan_assets import imports
    job_id = imports.submit("books", ["/data/books/"], format="parquet")
    imports.run(job_id)            # here, now (or let the DataCoord step pick it up)
    imports.status(job_id).state   # Completed

A job lives at `{root}/meta/import/{jobID}` (`jobs.ImportJob`) and moves Pending ->
PreImporting -> Importing -> Completed or Failed (with the reason naming the file and
column at fault). `executor` describes the commit order that makes a job all-or-nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import DEFAULT_PARTITION, CollectionRegistry, PartitionNotFoundError
from vchan_assets.imports.executor import ImportExecutor, Progress
from vchan_assets.imports.files import FileSource, ImportInputError
from vchan_assets.imports.jobs import (
    KEY_PARTITIONS,
    ImportFile,
    ImportFormat,
    ImportJob,
    ImportJobConflictError,
    ImportJobNotFoundError,
    ImportJobTakenError,
    ImportState,
    create_job,
    get_job,
    list_jobs,
)
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.spark import Engine

__all__ = [
    "ImportFormat",
    "ImportInputError",
    "ImportJob",
    "ImportJobConflictError",
    "ImportJobNotFoundError",
    "ImportState",
    "jobs",
    "run",
    "status",
    "submit",
    "wait",
]


@contextmanager
def _store(store: MetaStore | None, settings: Settings | None) -> Iterator[tuple[MetaStore, Settings]]:
    settings = settings or Settings.from_env()
    if store is not None:
        yield store, settings
        return
    from vchan_assets.stack import Stack

    stack = Stack.open(settings)
    try:
        yield stack.store, settings
    finally:
        stack.store.close()


def submit(
    collection: str,
    files: Sequence[str],
    *,
    partition: str = DEFAULT_PARTITION,
    format: str = "parquet",
    job_id: int | None = None,
    upsert: bool = False,
    drop_unknown_columns: bool = False,
    store: MetaStore | None = None,
    settings: Settings | None = None,
) -> int:
    """Create an import job (Pending) and return its id. The same `job_id` submitted
    again returns it without importing twice (different content: ImportJobConflictError).
    Directories stand for the files of the format under them. With `upsert`, rows whose
    pk is already in the collection are replaced (a delete at the import's timestamp)."""
    fmt = ImportFormat(format)
    with _store(store, settings) as (meta, conf):
        info = CollectionRegistry(meta).get_by_name(collection)
        key = info.schema.partition_key
        if key is not None:  # each row goes to the hidden partition its key picks
            if partition != DEFAULT_PARTITION:
                raise ValueError(
                    f"collection {collection!r} has a partition key ({key.name!r}): its rows go to the "
                    f"partition their key picks, an import names no partition (got {partition!r})"
                )
            partition_id = KEY_PARTITIONS
        elif partition not in info.partition_names:
            raise PartitionNotFoundError(collection, partition)
        else:
            partition_id = info.partition_id(partition)
        paths = FileSource(conf.s3_endpoint, conf.s3_region).expand(list(files), fmt)
        now = time.time()
        job = ImportJob(
            job_id=IdAllocator(meta).alloc() if job_id is None else job_id,
            collection_id=info.id,
            collection=info.name,
            partition_id=partition_id,
            partition=partition,
            files=tuple(ImportFile(p) for p in paths),
            format=fmt,
            upsert=upsert,
            drop_unknown_columns=drop_unknown_columns,
            created_at=now,
            updated_at=now,
        )
        stored, _created = create_job(meta, job)
        return stored.model.job_id


def run(
    job_id: int,
    *,
    engine: Engine = "spark",
    on_progress: Progress | None = None,
    store: MetaStore | None = None,
    settings: Settings | None = None,
) -> ImportJob:
    """Run the job here until Completed or Failed; its final meta. If another executor
    (the DataCoord) took the job meanwhile, wait for that one to finish it."""
    from vchan_assets.storage import Storage
    from vchan_assets.system import System

    with _store(store, settings) as (meta, conf):
        system = System(conf, meta, Storage.from_settings(conf))
        try:
            return ImportExecutor(system, engine, on_progress=on_progress).run(job_id)
        except ImportJobTakenError:
            return wait(
                job_id, timeout=conf.import_timeout * conf.import_max_attempts, store=meta, settings=conf
            )


def status(job_id: int, *, store: MetaStore | None = None, settings: Settings | None = None) -> ImportJob:
    with _store(store, settings) as (meta, _):
        return get_job(meta, job_id).model


def jobs(*, store: MetaStore | None = None, settings: Settings | None = None) -> list[ImportJob]:
    with _store(store, settings) as (meta, _):
        return [d.model for d in list_jobs(meta)]


def wait(
    job_id: int,
    timeout: float = 3600.0,
    interval: float = 0.5,
    *,
    store: MetaStore | None = None,
    settings: Settings | None = None,
) -> ImportJob:
    """Poll until the job is Completed or Failed (run by someone else, e.g. the DataCoord);
    TimeoutError naming the job and its state otherwise."""
    deadline = time.monotonic() + timeout
    with _store(store, settings) as (meta, _):
        while True:
            job = get_job(meta, job_id).model
            if job.done:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"import job {job_id} is still {job.state} after {timeout:g}s")
            time.sleep(interval)
