"""Bulk import jobs as the `imported_segments` asset, partitioned by job id (a dynamic
partition per job in `meta/import/`), with checks, and a sensor that requests a run for
each job that is Pending or stuck. A run drives its job with the same executor the
`vchan datacoord` import step and `vchan import --wait` use (imports/executor.py); two of
them on one job never both commit (compare-and-swap on the job's version)."""

import time

import dagster as dg

from vchan_assets.defs.checks import asset_checks, check_result, typed
from vchan_assets.defs.resources import VchanEnvResource, VchanResource
from vchan_assets.imports.checks import check_no_existing_pks, check_rows_match_files
from vchan_assets.imports.executor import ImportExecutor
from vchan_assets.imports.files import FileSource
from vchan_assets.imports.jobs import ImportJobTakenError, ImportState, get_job, list_jobs

IMPORTED_SEGMENTS = dg.AssetKey("imported_segments")
IMPORT_JOBS = "import_jobs"
import_jobs = dg.DynamicPartitionsDefinition(name=IMPORT_JOBS)

CHECK_ROWS, CHECK_PKS = asset_checks(
    IMPORTED_SEGMENTS,
    blocking=True,
    rows_in_files_equal_rows_in_segments="Rows in the files = rows in the job's segments (counted again from both sides' footers).",
    no_pk_already_in_collection="No imported primary key was already live in the partition (unless the job upserts).",
)


@dg.asset(
    key=IMPORTED_SEGMENTS,
    partitions_def=import_jobs,
    group_name="bulk_import",
    kinds={"spark", "parquet", "etcd"},
    check_specs=[CHECK_ROWS, CHECK_PKS],
)
def imported_segments(context: dg.AssetExecutionContext, vchan: VchanResource) -> object:
    """Files imported straight into Flushed segments by one import job (meta/import/{jobID}):
    pre-import checks, binlogs per column group + stats logs written by Spark, all segments
    made visible in one etcd transaction."""
    job_id = int(context.partition_key)
    with vchan.open() as runtime:
        store, storage, settings = runtime.store, runtime.storage, runtime.settings
        started = time.monotonic()
        try:
            job = ImportExecutor(runtime).run(job_id)
        except ImportJobTakenError:
            context.log.info("import job %d is run by another executor: waiting for it", job_id)
            while not (job := get_job(store, job_id).model).done:
                time.sleep(1.0)
        seconds = time.monotonic() - started
        if job.state is not ImportState.COMPLETED:
            raise dg.Failure(f"import job {job_id} failed: {job.reason}", metadata={"reason": job.reason})
        source = FileSource(settings.s3_endpoint, settings.s3_region)
        rows = check_rows_match_files(store, storage, source, job)
        pks = check_no_existing_pks(store, storage, job)
    yield dg.MaterializeResult(
        metadata=typed(
            {
                "collection": job.collection,
                "partition": job.partition,
                "files": len(job.files),
                "rows": job.imported_rows,
                "bytes_in": job.bytes,
                "segments": dg.MetadataValue.json(list(job.segment_ids)),
                "rows_per_second": round(job.imported_rows / seconds, 1) if seconds > 0 else 0.0,
            }
        )
    )
    yield check_result(CHECK_ROWS, rows)
    yield check_result(CHECK_PKS, pks)


import_job = dg.define_asset_job(
    "bulk_import",
    selection=dg.AssetSelection.assets(IMPORTED_SEGMENTS),
    executor_def=dg.in_process_executor,
    description="One bulk import job (the partition key is its job id).",
)


@dg.sensor(job=import_job, minimum_interval_seconds=5, default_status=dg.DefaultSensorStatus.RUNNING)
def import_sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
    """DataCoord automation: a run for every Pending job, and for a job without progress
    for VCHAN_IMPORT_TIMEOUT (its executor died); one run per job and attempt."""
    with vchan_env.open() as runtime:
        settings = runtime.settings
        jobs = [d.model for d in list_jobs(runtime.store)]
    now = time.time()
    due = [
        j
        for j in jobs
        if j.state is ImportState.PENDING or (not j.done and now - j.updated_at > settings.import_timeout)
    ]
    known = set(context.instance.get_dynamic_partitions(IMPORT_JOBS))
    new = sorted({str(j.job_id) for j in due} - known)
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(partition_key=str(j.job_id), run_key=f"import-{j.job_id}-{j.attempt}") for j in due
        ],
        dynamic_partitions_requests=[import_jobs.build_add_request(new)] if new else [],
    )
