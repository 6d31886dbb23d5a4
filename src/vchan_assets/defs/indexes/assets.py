"""The index builds in the lineage: `segments` -> `sorted_segments` -> `segment_indexes`.

`segment_indexes`, partitioned by vchannel: a build of each live index of the vchannel's
collection for every sorted segment of the vchannel that has none, then the vchannel's
Unissued builds run as one Spark job (`indexes.step.IndexBuilder`, one Spark task per
build), with three checks (`query/index_checks.py`): every sorted segment of >= 1,024 rows
has a Finished build per index; each built index holds its segment's rows; recall@10 of a
sample of each segment's own vectors at the default search parameters is at least
VCHAN_INDEX_RECALL_FLOOR.

`index_sensor` requests a run for each vchannel whose sorted segments lack a build, or
whose builds wait Unissued, once per (newest such segment, count) (the run key).
"""

import dagster as dg

from vchan_assets.defs.checks import asset_checks, check_result, typed
from vchan_assets.defs.lifecycle.assets import LIFECYCLE_GROUP, SORTED_SEGMENTS
from vchan_assets.defs.partitions import VCHANNELS, vchannels
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.indexes.engine import reader_session
from vchan_assets.indexes.meta import create_missing_builds
from vchan_assets.indexes.step import IndexBuilder, IndexReport
from vchan_assets.query.index_checks import (
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


def index_vchannel(runtime: VchanRuntime, vchannel: str) -> IndexReport:
    """`index_step` for one vchannel: the builds its sorted segments lack (of every live
    index of its collection), then its Unissued builds run as one job."""
    info = runtime.collection_of(vchannel)
    report = IndexReport(created=[b.build_id for b in create_missing_builds(runtime.store, info)])
    todo = [b.build_id for b in vchannel_indexes(runtime.store, info, vchannel).unissued()]
    if todo:
        report.merge(IndexBuilder(runtime, "spark").run(build_ids=todo, collection_id=info.id))
    return report


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
        report = index_vchannel(runtime, vchannel)
        found = vchannel_indexes(runtime.store, runtime.collection_of(vchannel), vchannel)
        finished = check_builds_finished(found)
        rows = check_index_rows(runtime.storage, found)
        recall = check_recall(runtime.storage, found, runtime.settings.index_recall_floor)
    context.log.info(
        "%s: %d builds created, %d finished, %d failed", vchannel, len(report.created), len(report.finished),
        len(report.failed),
    )  # fmt: skip
    yield dg.MaterializeResult(
        metadata=typed(
            {
                "created": len(report.created),
                "finished": len(report.finished),
                "failed": len(report.failed),
                "rows_indexed": report.rows,
                "build_s": round(report.seconds, 3),
                "indexes": len(found.indexes),
                "segments": len(found.segments),
                "built": len(found.built()),
                "recall_min": recall.metadata["recall_min"],
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
def index_sensor(context: dg.SensorEvaluationContext, vchan: VchanResource) -> dg.SensorResult:
    """A `segment_indexes` run for each vchannel whose sorted segments lack a build of a
    live index, or whose builds wait Unissued (run key: newest such segment and count)."""
    with vchan.open() as runtime:
        waiting: dict[str, tuple[int, int]] = {}
        for vchannel, info in runtime.vchannels().items():
            found = vchannel_indexes(runtime.store, info, vchannel)
            segments = [s.id for s, _ in found.missing()] + [b.segment_id for b in found.unissued()]
            if segments:
                waiting[vchannel] = (max(segments), len(segments))
    known = set(context.instance.get_dynamic_partitions(VCHANNELS))
    requests = [
        dg.RunRequest(run_key=f"index-{v}-{newest}-{count}", partition_key=v, tags=INDEX_RUN_TAGS)
        for v, (newest, count) in sorted(waiting.items())
        if v in known
    ]
    if not requests:
        return dg.SensorResult(skip_reason="no sorted segment lacks its index build")
    return dg.SensorResult(run_requests=requests)
