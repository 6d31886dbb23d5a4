"""Running an import job to its end (Milvus' importScheduler and importChecker).

Commit order, each step a compare-and-swap on the job's version:
  1. pre-import: PreImporting, every file checked and counted; then Importing with the
     counts and the job's one TSO timestamp                    failpoint import_after_preimport
  2. the import tasks write binlogs + stats logs (Spark job, one task per file or slice
     of row groups), nothing in etcd yet                         failpoint import_after_binlogs
  3. register: the segments created in state Importing (invisible to readers) and their
     ids recorded in the job                                     failpoint import_before_commit
  4. commit: the segments Importing -> Flushed and the job Completed, only if the job,
     the collection and every segment are as read.
A job of at most CHUNK_SEGMENTS segments does 3 and 4 in ONE transaction each: it is
never half visible. A larger one cannot (etcd allows 128 operations per transaction), so
3 and 4 are chained, as Milvus' catalog AlterSegments splits its writes into transactions
of at most 64 operations: the segments' meta goes to a manifest file and the job records
their reserved ids and the manifest first; each transaction of 3 then puts a chunk of
segments and the job's `registered` count (failpoint import_mid_register after the
first), each transaction of 4 flips a chunk to Flushed and the job's `committed` count
(failpoint import_mid_commit after the first), the last one marks the job Completed.
Every chunk expects the job's version, so a restarted executor goes on from the counts:
no segment is registered twice or lost. Visibility of such a job is per chunk: a reader
between two commit transactions sees the chunks committed so far.
A crash before 3 leaves only files no meta names (orphans for garbage collection): the
job is imported again from step 2. A crash after 3 began leaves segments the job names:
it is finished by 3 and 4. A failed job drops its Importing segments in the transactions
that mark it Failed (the reason recorded by the first, failpoint import_mid_fail after
it, Failed by the last); a failure in the middle of a chained commit leaves the chunks
already Flushed visible.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.datacoord import segment_ops
from vchan_assets.datacoord.segment_manager import max_rows_of
from vchan_assets.datacoord.tasks import memory_batches
from vchan_assets.errors import DeclaredError
from vchan_assets.failpoints import failpoint
from vchan_assets.imports.files import FileSource, ImportInputError
from vchan_assets.imports.jobs import (
    KEY_PARTITIONS,
    ImportFile,
    ImportJob,
    ImportJobTakenError,
    ImportState,
    get_job,
    update_job,
)
from vchan_assets.imports.preimport import pre_import
from vchan_assets.imports.task import (
    RESULT_SCHEMA,
    ImportSpec,
    TaskResult,
    outcome_of,
    run_pickled,
    run_tasks_arrow,
)
from vchan_assets.meta.allocator import IdAllocator, TimestampOracle
from vchan_assets.meta.codec import decode_dict, encode
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.spark import Engine
from vchan_assets.storage import StorageError
from vchan_assets.system import System

log = logging.getLogger(__name__)

# What one of a job's transactions changes: the versions it expects, the records it puts
# and the keys it deletes.
_Changes = tuple[dict[str, int], dict[str, Any], list[str]]

# etcd's default limit is 128 operations per transaction (meta.store.MAX_TXN_OPS): one
# transaction of the register or the commit holds this many segments at most, with the job
# and the collection, and at most CHUNK_BYTES of their meta (MAX_REQUEST_BYTES is 1.5 MiB).
# A registration puts 2 keys per segment (its meta and its vchannel's index entry,
# `SegmentMeta.create_puts`) and the job: 121 operations.
CHUNK_SEGMENTS = 60
# A failing job's segments dropped per transaction: each moves to the dropped family (a put
# and 2 deletes, `SegmentMeta.writes`), with the job: 121 operations.
DROP_CHUNK_SEGMENTS = 40
CHUNK_BYTES = 1 << 20
# A sanity bound: the job's value lists every segment id, its manifest every segment's meta.
MAX_SEGMENTS_PER_JOB = 10_000
# What an import task holds: its row buffer (VCHAN_IMPORT_BUFFER_MB) and the binlogs it
# encodes from it; its estimate against VCHAN_TASK_MEMORY_MB.
IMPORT_MEMORY_FACTOR = 2.0
LOG_IDS_PER_TASK = 10_000
# Where a chained registration keeps its segments' meta until they are all in etcd (outside
# the binlog roots: garbage collection never takes it for an orphan binlog).
MANIFEST_ROOT = "import_manifest"
Progress = Callable[[ImportJob], None]


class ImportFailed(DeclaredError):
    """Internal: the job cannot succeed; `reason` goes into its meta."""

    reason: str
    message = "{reason}"


@dataclass(frozen=True)
class _Slice:
    file: ImportFile
    row_groups: tuple[int, ...] | None
    rows: int


def import_memory_mb(spec: ImportSpec) -> float:
    return IMPORT_MEMORY_FACTOR * spec.buffer_bytes / 2**20


class ImportExecutor:
    """Moves jobs from any state to Completed or Failed; safe to run again after a crash."""

    def __init__(
        self,
        system: System,
        engine: Engine = "spark",
        timeout: float = 3600.0,
        on_progress: Progress | None = None,
    ) -> None:
        self.store, self.storage, self.settings = system.store, system.storage, system.settings
        self.engine, self.timeout, self.spark = engine, timeout, system.spark
        self.on_progress = on_progress or (lambda job: None)
        self.ids = IdAllocator(system.store)
        self.tso = TimestampOracle(system.store)
        self.source = FileSource(system.settings.s3_endpoint, system.settings.s3_region)
        self.jobs: list[list[int]] = []  # the tasks of each Spark job run (admitted by memory)

    def run(self, job_id: int) -> ImportJob:
        """Drive the job to Completed or Failed; returns its final meta. Raises
        ImportJobTakenError if another executor moved it meanwhile."""
        job = self.current = get_job(self.store, job_id)
        if not job.model.done:  # one more attempt; also claims the job (CAS on its version)
            job = self._update(job, attempt=job.model.attempt + 1)
        while not job.model.done:
            self.on_progress(job.model)
            try:
                job = self._advance(job)
            except ImportFailed as exc:
                job = self.fail(self.current, exc.reason)  # the version this executor last wrote
        self.on_progress(job.model)
        return job.model

    def _advance(self, job: Decoded[ImportJob]) -> Decoded[ImportJob]:
        j = job.model
        if j.reason:  # a failure that dropped some of its segments, not yet all
            raise ImportFailed(j.reason)
        if j.state in (ImportState.PENDING, ImportState.PRE_IMPORTING):
            return self._pre_import(job)
        if j.registering:
            job = self._register_rest(job, self._manifest(j))
            failpoint("import_before_commit")
        if job.model.segment_ids:
            return self._commit(job)
        return self._import(job)

    def _update(self, job: Decoded[ImportJob], **changes: Any) -> Decoded[ImportJob]:
        self.current = update_job(self.store, job, **changes)
        return self.current

    # --- step 1: pre-import ----------------------------------------------------------

    def _pre_import(self, job: Decoded[ImportJob]) -> Decoded[ImportJob]:
        job = self._update(job, state=ImportState.PRE_IMPORTING)
        j = job.model
        info = self._collection(j).model
        try:
            files = pre_import(
                self.source, info.schema, [f.path for f in j.files], j.format, j.drop_unknown_columns
            )
        except ImportInputError as exc:
            raise ImportFailed(str(exc)) from None
        job = self._update(
            job,
            state=ImportState.IMPORTING,
            files=files,
            rows=sum(f.rows for f in files),
            bytes=sum(f.bytes for f in files),
            timestamp=self.tso.alloc(),
            progress=10,
        )
        failpoint("import_after_preimport")
        return job

    # --- step 2 and 3: binlogs, then the invisible segments --------------------------

    def _import(self, job: Decoded[ImportJob]) -> Decoded[ImportJob]:
        job = self._update(job, progress=10)  # a second executor now fails its next write
        j = job.model
        info = self._collection(j).model
        specs = self._specs(j, info)
        segments: list[SegmentInfo] = []
        for result in self._run(specs):
            if isinstance(result, ImportInputError | StorageError):
                raise ImportFailed(str(result))
            segments += result
        failpoint("import_after_binlogs")
        imported = sum(s.num_rows for s in segments if s.level is not SegmentLevel.L0)
        if imported != j.rows:
            raise ImportFailed(f"pre-import counted {j.rows} rows, the import wrote {imported}")
        job = self._register(self.current, segments)  # progress reports moved the job's version
        self.on_progress(job.model)
        failpoint("import_before_commit")
        return self._commit(job)

    def _specs(self, j: ImportJob, info: CollectionInfo) -> list[ImportSpec]:
        max_rows = max_rows_of(info, self.settings)
        slices = self._slices(j, max_rows)
        k = len(info.vchannels)
        key = info.schema.partition_key
        partitions = info.partitions if key is not None else (j.partition_id,)
        p = len(partitions)
        # Per task: a segment per (partition, vchannel), one more each time max_rows is
        # reached, and for an upsert the L0 segment of its deletes in each partition.
        deletes = p if j.upsert else 0
        per_task = [p * k + s.rows // max_rows + deletes for s in slices]
        if sum(per_task) > MAX_SEGMENTS_PER_JOB:
            raise ImportFailed(
                f"the job would write {sum(per_task)} segments, more than the {MAX_SEGMENTS_PER_JOB} "
                "one job may hold: split the files over several jobs"
            )
        first_segment = self.ids.alloc(sum(per_task))
        first_row = self.ids.alloc(max(1, j.rows))
        first_log = self.ids.alloc(LOG_IDS_PER_TASK * len(slices))
        specs = []
        seg_at, row_at = first_segment, first_row
        for i, (s, n_seg) in enumerate(zip(slices, per_task, strict=True)):
            specs.append(
                ImportSpec(
                    job_id=j.job_id,
                    task=i,
                    source=self.source,
                    path=s.file.path,
                    format=j.format,
                    row_groups=s.row_groups,
                    storage=self.storage,
                    schema=info.schema,
                    collection_id=info.id,
                    partition_id=j.partition_id,
                    vchannels=info.vchannels,
                    timestamp=j.timestamp,
                    row_id_base=row_at,
                    segment_ids=tuple(range(seg_at, seg_at + n_seg - deletes)),
                    upsert_segments=tuple(range(seg_at + n_seg - deletes, seg_at + n_seg)),
                    partition_key=key.name if key is not None else None,
                    key_partitions=info.partitions if key is not None else (),
                    log_id_base=first_log + i * LOG_IDS_PER_TASK,
                    log_id_count=LOG_IDS_PER_TASK,
                    max_rows=max_rows,
                    buffer_bytes=int(self.settings.import_buffer_mb * (1 << 20)),
                )
            )
            seg_at += n_seg
            row_at += s.rows
        return specs

    def _slices(self, j: ImportJob, max_rows: int) -> list[_Slice]:
        """One task per file; a Parquet file of more than a segment's rows is cut into
        slices of whole row groups (the row counts per group come from its footer)."""
        from vchan_assets.imports.files import parquet_file

        out = []
        for f in j.files:
            if f.row_groups <= 1 or f.rows <= max_rows:
                out.append(_Slice(f, None, f.rows))
                continue
            meta = parquet_file(self.source, f.path).metadata
            groups: list[int] = []
            rows = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if groups and rows + n > max_rows:
                    out.append(_Slice(f, tuple(groups), rows))
                    groups, rows = [], 0
                groups.append(g)
                rows += n
            out.append(_Slice(f, tuple(groups), rows))
        return out

    def _run(self, specs: list[ImportSpec]) -> list[TaskResult]:
        results: list[TaskResult] = []
        if self.engine == "local":  # one task at a time
            for i, spec in enumerate(specs):
                results.append(outcome_of(run_pickled(spec)))
                self._tasks_done(i + 1, len(specs))
            return results
        # Admitted by memory (VCHAN_TASK_MEMORY_MB): a Spark job of the tasks that fit, then the next.
        for batch in memory_batches(specs, import_memory_mb, self.settings.task_memory_mb):
            before = len(results)

            def progress(done: int, _total: int, before: int = before) -> None:
                self._tasks_done(before + done, len(specs))

            self.jobs.append([spec.task for spec in batch])
            results += _run_on_spark(self.settings, batch, self.timeout, self.spark, progress)
        return results

    def _tasks_done(self, done: int, total: int) -> None:
        """Progress 10..90 with the tasks finished, written to the job: it is also the
        heartbeat that tells the DataCoord this executor is alive (at least every third
        of VCHAN_IMPORT_TIMEOUT, even while one long task runs)."""
        job = self.current
        progress = 10 + 80 * done // max(1, total)
        stale = time.time() - job.model.updated_at > self.settings.import_timeout / 3
        if progress != job.model.progress or stale:
            self._update(job, progress=progress)
            self.on_progress(self.current.model)

    def _register(self, job: Decoded[ImportJob], segments: list[SegmentInfo]) -> Decoded[ImportJob]:
        """The segments (Importing) and their ids in the job: in one transaction if they fit,
        else their manifest and reserved ids first, then chunk after chunk."""
        j = job.model
        changes: dict[str, Any] = {
            "segment_ids": tuple(s.id for s in segments),
            "segment_partitions": tuple(s.partition_id for s in segments)
            if j.partition_id == KEY_PARTITIONS
            else (),
            "imported_rows": sum(s.num_rows for s in segments if s.level is not SegmentLevel.L0),
            "progress": 90,
        }
        if _chunk_len(segments) == len(segments):
            return self._register_chunk(job, segments, replace(j, **changes, registered=len(segments)))
        manifest = f"{MANIFEST_ROOT}/{j.job_id}/{j.attempt}.json"
        self.storage.write_atomic(manifest, encode({"segments": [s.to_dict() for s in segments]}))
        job = self._update(job, **changes, manifest=manifest, registered=0)
        return self._register_rest(job, segments)

    def _register_rest(self, job: Decoded[ImportJob], segments: list[SegmentInfo]) -> Decoded[ImportJob]:
        """The segments the job has not registered yet, a chunk per transaction, each with
        the job's new `registered` count."""
        while (at := job.model.registered) < len(segments):
            n = _chunk_len(segments[at:])
            job = self._register_chunk(job, segments[at : at + n], replace(job.model, registered=at + n))
            if at == 0 and job.model.registering:
                failpoint("import_mid_register")
        return job

    def _register_chunk(
        self, job: Decoded[ImportJob], segments: list[SegmentInfo], updated: ImportJob
    ) -> Decoded[ImportJob]:
        """One transaction: `segments` created (none may exist) and the job as `updated`,
        if the job is as read."""
        door = SegmentMeta(self.store)
        puts: dict[str, Any] = {k: v for s in segments for k, v in door.create_puts(s).items()}
        expect = {door.key(s): 0 for s in segments}
        puts[job.kv.key] = replace(updated, updated_at=time.time())
        expect[job.kv.key] = job.kv.version
        if self.store.txn(expect, puts) is None:
            raise ImportJobTakenError(updated.job_id)
        self.current = get_job(self.store, updated.job_id)
        return self.current

    def _manifest(self, j: ImportJob) -> list[SegmentInfo]:
        """The segments of a chained registration, as its manifest file holds them."""
        body = decode_dict(j.manifest, self.storage.read_bytes(j.manifest))
        segments = [SegmentInfo.from_dict(d) for d in body["segments"]]
        if tuple(s.id for s in segments) != j.segment_ids:
            raise ImportFailed(f"the manifest {j.manifest} does not list the job's segments")
        return segments

    # --- step 4: visible ------------------------------------------------------------

    def _commit(self, job: Decoded[ImportJob]) -> Decoded[ImportJob]:
        """The segments not committed yet Importing -> Flushed, a chunk per transaction that
        also checks the collection is the one read (not dropped meanwhile) and records the
        job's `committed` count; the one with the last chunk marks the job Completed."""
        if job.model.manifest:  # every segment is registered: the manifest is no longer needed
            self.storage.delete(job.model.manifest)
        while True:
            j = job.model
            rest = j.segment_ids[j.committed :]
            self._collection(j)  # a dropped collection (its segments with it) fails the job as such
            n = _chunk_len([d.model for _, d in self._segments(j, rest[:CHUNK_SEGMENTS])])
            chunk, last = rest[:n], n == len(rest)
            now = time.time()
            done = replace(j, committed=j.committed + n, updated_at=now)
            if last:
                done = replace(done, state=ImportState.COMPLETED, progress=100, finished_at=now)
            gave_up = ImportFailed("the collection kept changing during the commit")
            job = self.current = self._finish(job, done, partial(self._flushed, j, chunk), gave_up)
            if last:
                break
            if j.committed == 0:
                failpoint("import_mid_commit")
            self.on_progress(job.model)
        log.info(
            "import job %d: %d rows visible in %d segments", j.job_id, j.imported_rows, len(j.segment_ids)
        )
        return job

    def _flushed(self, j: ImportJob, chunk: Sequence[int]) -> _Changes:
        """The versions a commit transaction expects (the chunk's segments, the collection)
        and its puts (the chunk Flushed)."""
        collection = self._collection(j).kv
        segments = self._segments(j, chunk)
        expect = {k: d.kv.version for k, d in segments} | {collection.key: collection.version}
        return expect, {k: d.model.with_changes(state=SegmentState.FLUSHED) for k, d in segments}, []

    def _segments(self, j: ImportJob, ids: Sequence[int]) -> list[tuple[str, Decoded[SegmentInfo]]]:
        out = []
        for seg_id in ids:
            key = self.store.keys.segment(j.collection_id, j.partition_of(seg_id), seg_id)
            found = self.store.get_model(key, SegmentInfo)
            if found is None or found.model.state is not SegmentState.IMPORTING:
                state = found.model.state if found else "missing"
                raise ImportFailed(f"segment {seg_id} of the job is {state}, not Importing")
            out.append((key, found))
        return out

    # --- failing ------------------------------------------------------------------------

    def fail(self, job: Decoded[ImportJob], reason: str) -> Decoded[ImportJob]:
        """Failed with `reason`; its Importing segments Dropped (their files go to garbage
        collection), in the same transaction if they fit in one, else a chunk per
        transaction: the first records the reason (a restarted executor goes on failing),
        the last marks the job Failed. Segments a chained commit already made Flushed stay."""
        j = job.model
        importing = [d.model for _, d in self._importing(j, j.segment_ids)]
        chunks: list[tuple[int, ...]] = []
        while importing or not chunks:
            n = _chunk_len(importing, DROP_CHUNK_SEGMENTS)
            chunks.append(tuple(s.id for s in importing[:n]))
            importing = importing[n:]

        for i, ids in enumerate(chunks):
            j = job.model
            now = time.time()
            done = replace(j, reason=reason, updated_at=now)
            if i == len(chunks) - 1:
                done = replace(done, state=ImportState.FAILED, finished_at=now)
            job = self.current = self._finish(
                job, done, partial(self._drops, j, ids), ImportJobTakenError(j.job_id)
            )
            if i == 0 and len(chunks) > 1:
                failpoint("import_mid_fail")
        if j.manifest:
            self.storage.delete(j.manifest)
        log.warning("import job %d failed: %s", j.job_id, reason)
        return job

    def _drops(self, j: ImportJob, ids: Sequence[int]) -> _Changes:
        """Each Importing segment of `ids` Dropped: moved to the dropped family."""
        found = self._importing(j, ids)
        door = SegmentMeta(self.store)
        puts: dict[str, Any] = {}
        deletes: list[str] = []
        for _, d in found:
            written, gone = door.writes(segment_ops.drop(d.model) or d.model)  # (Importing: dropped)
            puts.update(written)
            deletes += gone
        return {k: d.kv.version for k, d in found}, puts, deletes

    def _importing(self, j: ImportJob, ids: Sequence[int]) -> list[tuple[str, Decoded[SegmentInfo]]]:
        """Those of `ids` whose segment is Importing, with their keys."""
        out = []
        for seg_id in ids:
            key = self.store.keys.segment(j.collection_id, j.partition_of(seg_id), seg_id)
            found = self.store.get_model(key, SegmentInfo)
            if found is not None and found.model.state is SegmentState.IMPORTING:
                out.append((key, found))
        return out

    def _finish(
        self,
        job: Decoded[ImportJob],
        done: ImportJob,
        changes: Callable[[], _Changes],
        gave_up: Exception,
    ) -> Decoded[ImportJob]:
        """The job as `done` and `changes()` (versions to expect, records to put, keys to
        delete) in one transaction that also expects the job as this executor read it. When
        something else moved, `changes` is read again; when the job itself moved, another
        executor owns it (ImportJobTakenError); `gave_up` after 20 rounds."""
        for _ in range(20):
            expect, puts, deletes = changes()
            if (
                self.store.txn({**expect, job.kv.key: job.kv.version}, {**puts, job.kv.key: done}, deletes)
                is not None
            ):
                return get_job(self.store, done.job_id)
            if get_job(self.store, done.job_id).kv.version != job.kv.version:
                raise ImportJobTakenError(done.job_id)
        raise gave_up

    # --- helpers -----------------------------------------------------------------------

    def _collection(self, j: ImportJob) -> Decoded[CollectionInfo]:
        """The job's collection as etcd holds it now (with its version, for a commit that
        expects it unchanged); ImportFailed if it or the job's partition was dropped."""
        found = self.store.get_model(self.store.keys.collection(j.collection_id), CollectionInfo)
        if found is None or found.model.dropped_at:
            raise ImportFailed(f"collection {j.collection!r} was dropped during the job")
        if j.partition_id != KEY_PARTITIONS and j.partition_id not in found.model.partitions:
            raise ImportFailed(f"partition {j.partition!r} of {j.collection!r} was dropped during the job")
        return found


def _chunk_len(segments: Sequence[SegmentInfo], most: int = CHUNK_SEGMENTS) -> int:
    """How many of `segments`, from the first, one transaction holds: at most `most` and
    CHUNK_BYTES of meta, at least one."""
    size = 0
    for n, seg in enumerate(segments[:most]):
        size += len(encode(seg))
        if n and size > CHUNK_BYTES:
            return n
    return min(len(segments), most)


def _run_on_spark(
    settings: Settings,
    specs: list[ImportSpec],
    timeout: float,
    spark: Any = None,
    on_tasks: Callable[[int, int], None] | None = None,
) -> list[TaskResult]:
    from vchan_assets.spark.session import get_spark, run_arrow_tasks

    spark = spark or get_spark(settings)
    with _TaskMonitor(spark, len(specs), on_tasks):
        rows = run_arrow_tasks(
            spark, run_tasks_arrow, specs, RESULT_SCHEMA, f"import of {len(specs)} files", timeout
        )
    by_task = {r["task"]: outcome_of(r.asDict()) for r in rows}
    return [by_task[s.task] for s in specs]


class _TaskMonitor:
    """Reports finished tasks of the running import stage once a second (classic Spark
    sessions: Spark Connect has no status tracker; there the job reports at its end)."""

    def __init__(self, spark: Any, total: int, on_tasks: Callable[[int, int], None] | None) -> None:
        from vchan_assets.spark.session import settings_is_connect

        self.spark, self.total, self.on_tasks = spark, total, on_tasks
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if on_tasks is not None and not settings_is_connect(spark):
            self.thread = threading.Thread(target=self._watch, name="import-progress", daemon=True)

    def __enter__(self) -> _TaskMonitor:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def _watch(self) -> None:
        assert self.on_tasks is not None
        tracker = self.spark.sparkContext.statusTracker()
        reported = -1
        while not self.stop.wait(1.0):
            stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
            done = max((s.numCompletedTasks for s in stages if s and s.numTasks == self.total), default=0)
            if done != reported:
                reported = done
                try:
                    self.on_tasks(done, self.total)
                except ImportJobTakenError:
                    return  # the commit step will say so
