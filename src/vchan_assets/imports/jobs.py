"""Import jobs in etcd (`{root}/meta/import/{jobID}`), Milvus' importMeta.

    Pending --> PreImporting --> Importing --> Completed
       |             |               |
       +-------------+---------------+--> Failed (+ reason; its Importing segments Dropped)

Every change of a job is a compare-and-swap on the version its writer read, so two
executors never both move one job: the loser gets `ImportJobTakenError` and stops (its
files are orphans for garbage collection).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace
from typing import Any

from vchan_assets.errors import DeclaredError
from vchan_assets.meta.errors import CasConflictError, MetaError
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import Record


class ImportState(enum.StrEnum):
    PENDING = "Pending"
    PRE_IMPORTING = "PreImporting"
    IMPORTING = "Importing"
    COMPLETED = "Completed"
    FAILED = "Failed"


ACTIVE = (ImportState.PENDING, ImportState.PRE_IMPORTING, ImportState.IMPORTING)
FINISHED = (ImportState.COMPLETED, ImportState.FAILED)


class ImportFormat(enum.StrEnum):
    PARQUET = "parquet"
    JSON = "json"  # JSON lines: one object per line
    CSV = "csv"  # a header row; vectors as JSON arrays ("[0.1, 0.2]")


@dataclass(frozen=True)
class ImportFile(Record):
    """One input file: its path (local, or s3://bucket/key) and what pre-import counted."""

    path: str
    rows: int = 0
    bytes: int = 0
    row_groups: int = 0  # Parquet: the unit a file is sliced by


# The `partition_id` of a job into a collection with a partition key: each row goes to the
# hidden partition its key hashes to (as an insert does), not to one partition.
KEY_PARTITIONS = -1


@dataclass(frozen=True)
class ImportJob(Record):
    OMIT_WHEN_DEFAULT = frozenset({"segment_partitions"})

    job_id: int
    collection_id: int
    collection: str
    partition_id: int
    partition: str
    files: tuple[ImportFile, ...]
    format: ImportFormat = ImportFormat.PARQUET
    state: ImportState = ImportState.PENDING
    reason: str = ""  # why it failed (set first, while a failure drops segments over several transactions)
    drop_unknown_columns: bool = False  # else an extra column fails the job
    upsert: bool = False  # a delete of every imported pk at the import timestamp
    progress: int = 0  # percent
    rows: int = 0  # counted by pre-import
    bytes: int = 0
    imported_rows: int = 0  # in the committed segments
    segment_ids: tuple[int, ...] = ()  # its segments, in the order they are registered and committed
    # The partition of each of `segment_ids` when they are not all `partition_id`'s (a job
    # into a collection with a partition key); empty otherwise.
    segment_partitions: tuple[int, ...] = ()
    # A job of more segments than one transaction holds (executor.CHUNK_SEGMENTS): its segments' meta in a manifest
    # file, how many of them are in etcd (Importing or later), how many the commit made Flushed.
    manifest: str = ""
    registered: int = 0
    committed: int = 0
    timestamp: int = 0  # one TSO timestamp for every row of the job (as Milvus)
    attempt: int = 0  # executors that took the job on (the DataCoord step gives up after a limit)
    created_at: float = 0.0
    updated_at: float = 0.0  # last progress: a job without any for the timeout is stuck
    finished_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.state in FINISHED

    def partition_of(self, segment_id: int) -> int:
        """The partition of one of the job's segments (where its meta key is)."""
        if not self.segment_partitions:
            return self.partition_id
        return self.segment_partitions[self.segment_ids.index(segment_id)]

    @property
    def registering(self) -> bool:
        """Segment ids reserved, some of their segments not yet in etcd (only a job whose
        registration is chained over several transactions is ever seen so)."""
        return bool(self.manifest) and self.registered < len(self.segment_ids)

    def validate(self) -> None:
        if not self.files:
            raise ValueError("an import job needs at least one file")
        if self.segment_partitions and len(self.segment_partitions) != len(self.segment_ids):
            raise ValueError("segment_partitions must name the partition of each of segment_ids")


class ImportJobError(MetaError):
    """Base class of import job errors."""


class ImportJobNotFoundError(DeclaredError, ImportJobError, LookupError):
    job_id: int
    message = "import job {job_id} does not exist"


class ImportJobConflictError(DeclaredError, ImportJobError):
    """A job id submitted again with different content."""

    job_id: int
    detail: str
    message = "import job {job_id} exists with different {detail}: use another job id"


class ImportJobTakenError(DeclaredError, ImportJobError):
    """The job changed since this executor read it (another executor took it over)."""

    job_id: int
    message = "import job {job_id} changed meanwhile: another executor owns it"


def job_key(store: MetaStore, job_id: int) -> str:
    return store.keys.import_job(job_id)


def get_job(store: MetaStore, job_id: int) -> Decoded[ImportJob]:
    found = store.get_model(job_key(store, job_id), ImportJob)
    if found is None:
        raise ImportJobNotFoundError(job_id)
    return found


def list_jobs(store: MetaStore) -> list[Decoded[ImportJob]]:
    found, _ = store.list_models(store.keys.import_job.prefix, ImportJob)
    return sorted(found, key=lambda d: d.model.job_id)


def create_job(store: MetaStore, job: ImportJob) -> tuple[Decoded[ImportJob], bool]:
    """Create the job, or return the one already stored under its id (True: created).
    The same id with other files, collection or options is an ImportJobConflictError."""
    key = job_key(store, job.job_id)
    try:
        store.cas(key, 0, job)
        created = True
    except CasConflictError:
        created = False
    found = get_job(store, job.job_id)
    if not created:
        _same_request(found.model, job)
    return found, created


def _same_request(stored: ImportJob, asked: ImportJob) -> None:
    pairs = {
        "collection": (stored.collection_id, asked.collection_id),
        "partition": (stored.partition_id, asked.partition_id),
        "files": ([f.path for f in stored.files], [f.path for f in asked.files]),
        "options": (
            (stored.format, stored.upsert, stored.drop_unknown_columns),
            (asked.format, asked.upsert, asked.drop_unknown_columns),
        ),
    }
    for what, (a, b) in pairs.items():
        if a != b:
            raise ImportJobConflictError(stored.job_id, what)


def update_job(store: MetaStore, job: Decoded[ImportJob], **changes: Any) -> Decoded[ImportJob]:
    """Change a job if nobody did since `job` was read; ImportJobTakenError otherwise."""
    updated = replace(job.model, updated_at=time.time(), **changes)
    try:
        store.cas(job.kv.key, job.kv.version, updated)
    except CasConflictError:
        raise ImportJobTakenError(job.model.job_id) from None
    return get_job(store, job.model.job_id)
