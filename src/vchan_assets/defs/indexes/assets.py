"""The index builds in the lineage: `segments` -> `sorted_segments` -> `segment_indexes`.

`segment_indexes`, partitioned by vchannel: a build of each live index of the vchannel's
collection for every sorted segment of the vchannel that has none, then the vchannel's
builds run through the DataCoord's task scheduler (`indexes.tasks.build_vchannel`: an
index task per segment, with the attempts, backoff and Failed state of `vchan datacoord`;
one Spark job per batch, one Spark task per build), with three checks
(`query/index_checks.py`): every sorted segment of >= 1,024 rows has a Finished build per
index; each built index holds its segment's rows; recall@10 of a sample of each segment's
own vectors at the default search parameters is at least VCHAN_INDEX_RECALL_FLOOR.

`index_sensor` requests a run for each vchannel whose sorted segments lack a build, or
whose builds wait Unissued, or whose failed builds' task may run again, leaving out the
segments whose index task is backing off or Failed; once per (newest such segment, count,
their tasks' newest etcd revision) (the run key). It stands by while a `vchan datacoord`
process leads the election (its scheduler runs the builds).
"""

import time

import dagster as dg

from vchan_assets.datacoord.tasks import held_back, list_tasks
from vchan_assets.defs.checks import asset_checks, check_result, typed
from vchan_assets.defs.lifecycle.assets import LIFECYCLE_GROUP, SORTED_SEGMENTS, lifecycle_elsewhere
from vchan_assets.defs.partitions import VCHANNELS, vchannels
from vchan_assets.defs.resources import VchanEnvResource, VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.tasks import log_held, task_metadata
from vchan_assets.indexes.engine import reader_session
from vchan_assets.indexes.tasks import KIND, BuildRound, build_vchannel
from vchan_assets.meta.store import Decoded
from vchan_assets.model import SegmentIndexState, TaskRecord, TaskState
from vchan_assets.query.index_checks import (
    VchannelIndexes,
    check_builds_finished,
    check_index_rows,
    check_recall,
    vchannel_indexes,
)

SEGMENT_INDEXES = dg.AssetKey("segment_indexes")

CHECK_FINISHED, CHECK_ROWS, CHECK_RECALL = asset_checks(
    SEGMENT_INDEXES,
    builds_finished="Every sorted segment of the vchannel with >= 1,024 rows has a Finished build of each "
    "live index of its collection (none missing, pending, running or Failed).",
    index_rows="Each built index file holds as many rows as its segment (and as its build recorded).",
    index_recall="recall@10 of each built index on a sample of its segment's own vectors, at the default "
    "search parameters, against exact search: at least VCHAN_INDEX_RECALL_FLOOR (IVF_PQ measured only).",
)


def index_vchannel(runtime: VchanRuntime, vchannel: str) -> BuildRound:
    """One vchannel's builds through the task scheduler: the builds its sorted segments lack
    (of every live index of its collection), then the index tasks of its segments run, each
    batch as one job (`build_vchannel`)."""
    info = runtime.collection_of(vchannel)
    segments = [s.id for s in vchannel_indexes(runtime.store, info, vchannel).segments]
    return build_vchannel(runtime, "spark", info, segments)


@dg.asset(
    key=SEGMENT_INDEXES,
    deps=[SORTED_SEGMENTS],
    partitions_def=vchannels,
    group_name=LIFECYCLE_GROUP,
    kinds={"spark", "etcd"},
    description="The index builds of the vchannel's sorted segments (one per live vector index): faiss "
    "indexes built as Spark tasks, files at index_files/{build}/{version}/, Finished in one etcd "
    "transaction each.",
    check_specs=[CHECK_FINISHED, CHECK_ROWS, CHECK_RECALL],
)
def segment_indexes(context: dg.AssetExecutionContext, vchan: VchanResource) -> object:
    """Build the vchannel's missing segment indexes (one Spark job), then check them all."""
    vchannel = context.partition_key
    # The checks load the index files: this run states the engine versions it reads.
    with vchan.open() as runtime, reader_session(runtime.store, runtime.settings.session_ttl):
        built = index_vchannel(runtime, vchannel)
        report = built.builds
        found = vchannel_indexes(runtime.store, runtime.collection_of(vchannel), vchannel)
        finished = check_builds_finished(found)
        rows = check_index_rows(runtime.storage, found)
        recall = check_recall(runtime.storage, found, runtime.settings.index_recall_floor)
    context.log.info(
        "%s: %d builds created, %d finished, %d failed", vchannel, len(built.created), len(report.finished),
        len(report.failed),
    )  # fmt: skip
    log_held(context.log, f"{vchannel}: index", built.held)
    yield dg.MaterializeResult(
        metadata=typed(
            {
                "created": len(built.created),
                "finished": len(report.finished),
                "failed": len(report.failed),
                "rows_indexed": report.rows,
                "build_s": round(report.seconds, 3),
                "indexes": len(found.indexes),
                "segments": len(found.segments),
                "built": len(found.built()),
                "recall_min": recall.metadata["recall_min"],
                **task_metadata(built.report, built.held),
            }
        )
    )
    yield check_result(CHECK_FINISHED, finished)
    yield check_result(CHECK_ROWS, rows)
    yield check_result(CHECK_RECALL, recall)


index_job = dg.define_asset_job(
    "segment_index",
    selection=dg.AssetSelection.assets(SEGMENT_INDEXES),  # partitioned by vchannel like the asset
    executor_def=dg.in_process_executor,
    description="The index builds of one vchannel's sorted segments, run and checked.",
)


# Index builds are heavy Spark jobs: one at a time in the instance, dequeued after the
# syncs (dagster.yaml limits the `vchan/index` tag to 1 run), so they never hold the run
# slots syncs need.
INDEX_RUN_TAGS = {"vchan/index": "segment_indexes", "dagster/priority": "-1"}


@dg.sensor(job=index_job, minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING)
def index_sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
    """A `segment_indexes` run for each vchannel whose sorted segments lack a build of a
    live index, whose builds wait Unissued, or whose failed builds' task may run again
    (`builds_due`: a task backing off or Failed waits for its time); run key: newest such
    segment, count and their tasks' newest etcd revision. None while a `vchan datacoord`
    process leads the election (its scheduler runs the builds)."""
    with vchan_env.open() as runtime:
        elsewhere = lifecycle_elsewhere(runtime.store)
        waiting: dict[str, tuple[int, int, int]] = {}
        if not elsewhere:
            tasks = {d.model.segment_id: d for d in list_tasks(runtime.store, KIND)}
            now = time.time()
            for vchannel, info in runtime.vchannels().items():
                due = builds_due(vchannel_indexes(runtime.store, info, vchannel), tasks, now)
                if due:
                    waiting[vchannel] = (max(due), len(due), max(due.values()))
    if elsewhere:
        return dg.SensorResult(skip_reason=elsewhere)
    known = set(context.instance.get_dynamic_partitions(VCHANNELS))
    requests = [
        dg.RunRequest(run_key=f"index-{v}-{newest}-{count}-{revision}", partition_key=v, tags=INDEX_RUN_TAGS)
        for v, (newest, count, revision) in sorted(waiting.items())
        if v in known
    ]
    if not requests:
        return dg.SensorResult(
            skip_reason="no sorted segment lacks its index build (or their tasks wait for their next try)"
        )
    return dg.SensorResult(run_requests=requests)


def builds_due(found: VchannelIndexes, tasks: dict[int, Decoded[TaskRecord]], now: float) -> dict[int, int]:
    """The vchannel's segments with builds to run now, each with its index task's etcd
    revision (0: none yet): a build missing or Unissued, or Failed with its task queued or
    due again; a segment whose task is backing off or Failed (`held_back`) is left out."""
    failed = {b.segment_id for b in found.builds.values() if b.state is SegmentIndexState.FAILED}
    wanted = {s.id for s, _ in found.missing()} | {b.segment_id for b in found.unissued()}
    wanted |= {i for i in failed if i in tasks and tasks[i].model.state is not TaskState.IN_PROGRESS}
    due = {}
    for segment in wanted:
        task = tasks.get(segment)
        if task is None or not held_back(task.model, now):
            due[segment] = task.kv.mod_revision if task is not None else 0
    return due
