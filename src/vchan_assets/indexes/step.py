"""Running segment index builds, and the DataCoord's index step.

`IndexBuilder.run` takes Unissued builds: each is started (Unissued -> InProgress, next
version, a compare-and-swap: of two builders one wins), built on Spark (one Spark task
per build, `spark.session.run_arrow_tasks`) or in this process, and committed: its file
written first, then one transaction marking it Finished with its files, version, size and
engine version (failpoint `index_after_files` between the two). A build that fails is
marked Failed with the reason. Builds of a dropped index, or of a segment gone or Dropped,
are not started.

`index_step(system, engine)` is the periodic scan (Milvus keeps one as a safety net beside
its pushes): a build for every indexable segment of every live index that has none, then
`IndexBuilder.run`, then `release_waiting_outputs` (compaction outputs whose build Failed
or that waited too long replace their inputs without it). CreateIndex makes the builds of the segments there are at once
(`create_builds`), so the step only finds those sorted since.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from vchan_assets.datacoord.collections import CollectionNotFoundError, CollectionRegistry
from vchan_assets.failpoints import failpoint
from vchan_assets.indexes.build import (
    RESULT_SCHEMA,
    BuildOutput,
    BuildSpec,
    IndexBuildError,
    build_here,
    builds_arrow,
    outcome_of,
    waves,
)
from vchan_assets.indexes.engine import OURS, target_engine
from vchan_assets.indexes.meta import (
    BuiltFiles,
    create_missing_builds,
    fail_build,
    finish_build,
    list_builds,
    list_indexes,
    node_name,
    release_waiting_outputs,
    start_build,
)
from vchan_assets.meta.store import Decoded
from vchan_assets.model import (
    FieldIndex,
    IndexEngine,
    SegmentIndex,
    SegmentIndexState,
    SegmentInfo,
    SegmentState,
)
from vchan_assets.spark import Engine
from vchan_assets.system import System

log = logging.getLogger(__name__)


@dataclass
class IndexReport:
    created: list[int] = field(default_factory=list)  # build ids
    finished: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)  # (build id, reason)
    lost: list[int] = field(default_factory=list)  # started or changed by another builder meanwhile
    rows: int = 0  # rows indexed by the finished builds
    seconds: float = 0.0  # build time summed over the finished builds

    def merge(self, other: IndexReport) -> IndexReport:
        self.created += other.created
        self.finished += other.finished
        self.failed += other.failed
        self.lost += other.lost
        self.rows += other.rows
        self.seconds += other.seconds
        return self


class IndexBuilder:
    """Runs Unissued builds: all of them in one Spark job (or in this process). `versions`:
    the index engine versions this builder can write (`indexes.engine`); each run writes
    the lowest current stated by a live session within them."""

    def __init__(
        self,
        system: System,
        engine: Engine = "spark",
        timeout: float = 900.0,
        versions: IndexEngine = OURS,
    ) -> None:
        self.system = system
        self.store, self.storage = system.store, system.storage
        self.engine, self.timeout = engine, timeout
        self.versions = versions
        self.target = versions.current  # of the last run
        self.collections = CollectionRegistry(system.store)

    def run(
        self,
        build_ids: Collection[int] | None = None,
        collection_id: int | None = None,
        restart: bool = False,
    ) -> IndexReport:
        """Start, build and commit the Unissued builds (only `build_ids` if given).
        `restart`: also those InProgress or Failed (the scheduler's: its task of the build's
        segment is what says no one else builds it; the start's new version fences the
        old builder off)."""
        runnable = {SegmentIndexState.UNISSUED}
        if restart:
            runnable |= {SegmentIndexState.IN_PROGRESS, SegmentIndexState.FAILED}
        report = IndexReport()
        self.target = target_engine(self.store, self.versions)
        indexes = {d.model.index_id: d.model for d in list_indexes(self.store, collection_id)}
        started: list[tuple[Decoded[SegmentIndex], BuildSpec]] = []
        node = f"{node_name()}/{self.engine}"
        for d in list_builds(self.store, collection_id):
            b = d.model
            if b.state not in runnable or (build_ids is not None and b.build_id not in build_ids):
                continue
            index = indexes.get(b.index_id)
            segment = self._segment(b)
            if index is None or segment is None:
                continue  # index dropped, or segment gone: garbage collection's
            mine = start_build(self.store, d, node)
            if mine is None:
                report.lost.append(b.build_id)
                continue
            spec = self._spec(mine.model, index, segment)
            if spec is None:
                self._fail(mine, "the indexed field is not in the collection's schema", report)
                continue
            started.append((mine, spec))
        for (build, _spec), outcome in zip(started, self._build([s for _, s in started]), strict=True):
            self._commit(build, outcome, report)
        return report

    def _segment(self, b: SegmentIndex) -> SegmentInfo | None:
        key = self.store.keys.segment(b.collection_id, b.partition_id, b.segment_id)
        found = self.store.get_model(key, SegmentInfo)
        return None if found is None or found.model.state is SegmentState.DROPPED else found.model

    def _spec(self, b: SegmentIndex, index: FieldIndex, segment: SegmentInfo) -> BuildSpec | None:
        try:
            info = self.collections.get(b.collection_id, include_dropped=True)
        except CollectionNotFoundError:
            return None
        schema_field = next((f for f in info.schema.vector_fields if f.field_id == index.field_id), None)
        if schema_field is None:
            return None
        return BuildSpec(b.build_id, b.version, self.storage, segment, schema_field, index)

    def _build(self, specs: list[BuildSpec]) -> list[BuildOutput | IndexBuildError]:
        if not specs:
            return []
        if self.engine == "local":
            return build_here(specs)
        try:
            return _run_on_spark(self.system, specs, self.timeout)
        except Exception as exc:  # the whole job failed: each build fails with its reason
            log.exception("index builds %s: the Spark job failed", [s.build_id for s in specs])
            return [
                IndexBuildError(s.build_id, s.segment.id, f"Spark job failed: {exc}"[:2000]) for s in specs
            ]

    def _commit(
        self, build: Decoded[SegmentIndex], outcome: BuildOutput | IndexBuildError, report: IndexReport
    ) -> None:
        b = build.model
        if isinstance(outcome, IndexBuildError):
            log.error("%s", outcome)
            self._fail(build, outcome.reason, report)
            return
        failpoint("index_after_files")
        built = BuiltFiles(outcome.files, outcome.serialized_size, outcome.engine_version, self.target)
        if finish_build(self.store, build, built) is None:
            log.warning(
                "index build %d changed while it ran: its files %s are orphans", b.build_id, outcome.files
            )
            report.lost.append(b.build_id)
            return
        log.info(
            "index build %d (index %d, segment %d, version %d, engine %d): %d rows, %d bytes in %.2fs",
            b.build_id, b.index_id, b.segment_id, b.version, self.target, outcome.rows, outcome.serialized_size,
            outcome.seconds,
        )  # fmt: skip
        report.finished.append(b.build_id)
        report.rows += outcome.rows
        report.seconds += outcome.seconds

    def _fail(self, build: Decoded[SegmentIndex], reason: str, report: IndexReport) -> None:
        if fail_build(self.store, build, reason) is None:
            report.lost.append(build.model.build_id)
        else:
            report.failed.append((build.model.build_id, reason))


def _run_on_spark(
    system: System, specs: list[BuildSpec], timeout: float
) -> list[BuildOutput | IndexBuildError]:
    """The builds as Spark tasks, one per build, in `waves` over the session's cores (one
    Spark job per wave): a task has one core, except those of a last wave that would leave
    cores idle, which split them."""
    from vchan_assets.spark.session import get_spark, run_arrow_tasks, session_cores

    spark = system.spark or get_spark(system.settings)
    by_build: dict[int, BuildOutput | IndexBuildError] = {}
    for builds, threads in waves(len(specs), session_cores(spark)):
        wave = [(specs[i], threads) for i in builds]
        description = f"index builds {[s.build_id for s, _ in wave]} ({threads} threads each)"
        rows = run_arrow_tasks(spark, builds_arrow, wave, RESULT_SCHEMA, description, timeout)
        by_build |= {r["build_id"]: outcome_of(r.asDict()) for r in rows}
    return [by_build[s.build_id] for s in specs]


def index_step(system: System, engine: Engine = "spark") -> IndexReport:
    """The periodic scan: builds for the indexable segments that have none, then every
    Unissued build run (one job)."""
    report = IndexReport()
    infos = CollectionRegistry(system.store).list()
    for info in infos:
        report.created += [b.build_id for b in create_missing_builds(system.store, info)]
    report.merge(IndexBuilder(system, engine).run())
    for info in infos:  # outputs whose builds Failed (not retried here) or took too long
        release_waiting_outputs(system.store, info.id, system.settings.index_handoff_timeout)
    return report
