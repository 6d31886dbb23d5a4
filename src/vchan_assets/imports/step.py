"""The DataCoord's import step, the same whoever runs it (the `vchan datacoord` process or
the Dagster import sensor): start Pending jobs, take over stuck ones, fail those that ran
out of attempts (Milvus' importScheduler and importChecker), and delete finished jobs
older than VCHAN_IMPORT_JOB_RETENTION (as compaction plans are), so meta does not grow with
history.

A job is stuck when it made no progress (`updated_at`) for VCHAN_IMPORT_TIMEOUT seconds:
its executor died. Taking it over is safe at any step (see `executor`): a job whose
segments are registered (or, chained, partly registered) is registered on and committed,
any other is pre-imported or imported again; the dead executor's files are orphans for
garbage collection. A deleted chained job takes the manifest files of its attempts with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vchan_assets.imports.executor import MANIFEST_ROOT, ImportExecutor
from vchan_assets.imports.jobs import ImportJobTakenError, ImportState, list_jobs
from vchan_assets.meta.errors import CasConflictError
from vchan_assets.spark import Engine
from vchan_assets.system import System

log = logging.getLogger(__name__)


@dataclass
class ImportStepReport:
    started: list[int] = field(default_factory=list)  # Pending jobs run
    resumed: list[int] = field(default_factory=list)  # stuck jobs taken over
    completed: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)  # finished jobs past the retention


def import_step(system: System, engine: Engine = "spark", now: float | None = None) -> ImportStepReport:
    store, settings = system.store, system.settings
    now = time.time() if now is None else now
    report = ImportStepReport()
    executor = ImportExecutor(system, engine)
    for d in list_jobs(store):
        j = d.model
        if j.done:
            if now - j.finished_at > settings.import_job_retention:
                try:
                    store.cas(d.kv.key, d.kv.version, None)
                    report.deleted.append(j.job_id)
                except CasConflictError:
                    continue  # changed meanwhile: looked at again by the next step
                if j.manifest:  # a chained job: an attempt that died before naming its manifest left one
                    for key in system.storage.list_keys(f"{MANIFEST_ROOT}/{j.job_id}/"):
                        system.storage.delete(key)
            continue
        stuck = j.state is not ImportState.PENDING and now - j.updated_at > settings.import_timeout
        if j.state is not ImportState.PENDING and not stuck:
            continue  # a live executor is on it
        try:
            if stuck:
                log.warning(
                    "import job %d made no progress for %.0fs: taking it over", j.job_id, now - j.updated_at
                )
                if j.attempt >= settings.import_max_attempts and not j.segment_ids:
                    executor.fail(
                        d, f"no progress for {settings.import_timeout:g}s after {j.attempt} attempts"
                    )
                    report.failed.append(j.job_id)
                    continue
                report.resumed.append(j.job_id)
            else:
                report.started.append(j.job_id)
            final = executor.run(j.job_id)
        except ImportJobTakenError as exc:
            log.info("%s", exc)
            continue
        (report.completed if final.state is ImportState.COMPLETED else report.failed).append(j.job_id)
    return report
