"""Compaction triggers (which segments to merge or sort) and the executor of plans.

Triggers, as Milvus' compaction trigger: a Flushed L1 segment that is not sorted gets a
**sort** plan (the stats task after flush: the flush left it invisible, the sort's commit
puts its sorted copy in its place, visible); Flushed L1 segments of one (collection,
partition, vchannel) below a fraction of the max size and of one size tier get **mix**
plans that merge them up to the max size, and one with more deleted rows than a ratio is
rewritten without them; a manual trigger merges every Flushed segment of the collection. A mix output is sorted and visible too, so it replaces
invisible inputs as their sort would. Only Flushed segments are ever planned (never
Growing, Sealed or Flushing ones: a sync may still write those), and never one another
active plan holds.

The executor runs plans: Pending -> Executing, the task (Spark job or in-process)
writes the outputs' files, then `commit_compaction` swaps inputs for outputs in one
transaction. Failpoints, in commit order:
  compaction_after_files     output files written, no meta yet
  compaction_after_commit    outputs live, inputs Dropped, plan Completed
  compaction_before_cleanup  right before the plan is marked Cleaned
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.datacoord.segment_manager import max_rows_of
from vchan_assets.datacoord.tasks import memory_batches, worker_of
from vchan_assets.datanode.stats import PkStats
from vchan_assets.failpoints import failpoint
from vchan_assets.lifecycle.plans import (
    CompactionConflictError,
    CompactionPlan,
    CompactionType,
    PlanInput,
    PlanState,
    busy_segments,
    commit_compaction,
    create_plan,
    list_plans,
    read_inputs,
    transition,
)
from vchan_assets.lifecycle.task import (
    LOG_IDS_PER_PLAN,
    RESULT_SCHEMA,
    CompactionInputError,
    CompactionOutput,
    CompactionSpec,
    outcome_of,
    outputs_needed,
    run_compactions_arrow,
    run_pickled,
)
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.errors import MetaError, MetaUnavailableError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import (
    CollectionInfo,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    compose_ts,
    physical_ms,
)
from vchan_assets.spark import Engine
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import DELETE_COLUMNS, delete_paths, delete_paths_by_partition, read_files
from vchan_assets.system import System

log = logging.getLogger(__name__)


# --- triggers ------------------------------------------------------------------------------

# Inputs of one plan at most: its commit writes every input (a dropped one moves to the
# dropped family: 3 operations), every output (2 puts each: its meta and its vchannel's
# index entry), the plan and a chained link in one etcd transaction, and etcd refuses more
# than 128 operations in one (--max-txn-ops): 36 inputs are 108, with room for the outputs.
MAX_PLAN_SEGMENTS = 36
# What a compaction or sort holds in memory, over its input's binlog bytes (read, merged or
# sorted, written): its estimate against VCHAN_TASK_MEMORY_MB.
COMPACTION_MEMORY_FACTOR = 3.0
# L0 segments of one L0 plan at most: the rest of its transaction holds targets.
MAX_L0_PER_PLAN = MAX_PLAN_SEGMENTS // 2


def compactable(seg: SegmentInfo) -> bool:
    """Only Flushed L1/L2 segments with rows: a sync may still write any other."""
    return seg.state is SegmentState.FLUSHED and seg.level is not SegmentLevel.L0 and seg.num_rows > 0


@dataclass(frozen=True)
class Candidate:
    type: CompactionType
    segments: tuple[Decoded[SegmentInfo], ...]
    reason: str
    chained: tuple[int, ...] = ()  # L0: targets of the later links


def sort_candidates(segments: Sequence[Decoded[SegmentInfo]]) -> list[Candidate]:
    return [
        Candidate(CompactionType.SORT, (d,), "flushed segment not sorted by pk")
        for d in segments
        if not d.model.is_sorted and compactable(d.model)  # (most are sorted: checked first)
    ]


def size_tiers(members: Sequence[Decoded[SegmentInfo]], factor: float) -> list[list[Decoded[SegmentInfo]]]:
    """Segments cut into runs of similar size: from the smallest up, a run takes the next
    segment while that one is at most `factor` times the run's smallest."""
    runs: list[list[Decoded[SegmentInfo]]] = []
    for d in sorted(members, key=lambda d: (d.model.num_rows, d.model.id)):
        if runs and d.model.num_rows <= factor * runs[-1][0].model.num_rows:
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def mix_candidates(
    segments: Sequence[Decoded[SegmentInfo]],
    max_rows: int,
    small_proportion: float,
    delete_ratio: dict[int, float],
    delete_threshold: float,
    manual: bool = False,
    tier_factor: float = 2.0,
    expired_ratio: dict[int, float] | None = None,
) -> list[Candidate]:
    """Groups of one (partition, vchannel) to merge, each up to `max_rows` rows.

    Size-tiered, so a row is rewritten about log(total / new) times, not at every step:
    small segments merge only with others of their size tier (a grown merged segment
    waits until enough smaller ones grew to its size). A segment with more deleted rows
    than the threshold, or more rows a TTL expired (`expired_ratio`), is rewritten alone,
    those rows' bytes reclaimed."""
    if manual:
        return [
            Candidate(CompactionType.MIX, tuple(b), "manual")
            for members in _by_partition_and_vchannel(d for d in segments if compactable(d.model))
            for b in _pack(_by_id(members), max_rows)
        ]
    below = small_proportion * max_rows
    heavy_ids = {i for i, ratio in delete_ratio.items() if ratio > delete_threshold}
    expired_ids = {i for i, ratio in (expired_ratio or {}).items() if ratio > delete_threshold} - heavy_ids
    # One pass over the collection for the segments a rule can pick (at each step: most
    # segments are none of them), then the rules group by group.
    picked = (
        d
        for d in segments
        if (d.model.num_rows < below or d.model.id in heavy_ids or d.model.id in expired_ids)
        and compactable(d.model)
    )
    out = []
    for members in _by_partition_and_vchannel(picked):
        out += [
            Candidate(CompactionType.MIX, (d,), "delete ratio") for d in members if d.model.id in heavy_ids
        ]
        out += [
            Candidate(CompactionType.MIX, (d,), "expired rows (TTL)")
            for d in members
            if d.model.id in expired_ids
        ]
        small = [
            d
            for d in members
            if d.model.num_rows < below and d.model.id not in heavy_ids and d.model.id not in expired_ids
        ]
        for tier in size_tiers(small, tier_factor):
            for batch in _pack(_by_id(tier), max_rows) if len(tier) > 1 else []:
                if len(batch) > 1:
                    out.append(Candidate(CompactionType.MIX, tuple(batch), "small segments of one size tier"))
    return out


def _by_partition_and_vchannel(
    segments: Iterable[Decoded[SegmentInfo]],
) -> Iterable[list[Decoded[SegmentInfo]]]:
    """The segments grouped by (partition, vchannel), each group in the order given."""
    groups: dict[tuple[int, str], list[Decoded[SegmentInfo]]] = defaultdict(list)
    for d in segments:
        groups[(d.model.partition_id, d.model.vchannel)].append(d)
    return groups.values()


def _by_id(members: Sequence[Decoded[SegmentInfo]]) -> list[Decoded[SegmentInfo]]:
    return sorted(members, key=lambda d: d.model.id)


def _pack(members: list[Decoded[SegmentInfo]], max_rows: int) -> list[list[Decoded[SegmentInfo]]]:
    """Batches of up to `max_rows` rows and MAX_PLAN_SEGMENTS segments."""
    batches: list[list[Decoded[SegmentInfo]]] = []
    rows = 0
    for d in members:
        if not batches or rows + d.model.num_rows > max_rows or len(batches[-1]) >= MAX_PLAN_SEGMENTS:
            batches.append([])
            rows = 0
        batches[-1].append(d)
        rows += d.model.num_rows
    return batches


def expired_ratios(segments: Iterable[SegmentInfo], expire_before: int) -> dict[int, float]:
    """Per segment: the share of its rows a TTL expired, from its insert binlogs' timestamp
    ranges (a binlog counts once its newest row expired: no file is read)."""
    if not expire_before:
        return {}
    out = {}
    for seg in segments:
        if seg.num_rows and seg.binlogs:
            gone = sum(b.entries for b in seg.binlogs[0].logs if b.ts_to < expire_before)
            out[seg.id] = gone / seg.num_rows
    return out


def delete_ratios(storage: Storage, segments: Sequence[SegmentInfo]) -> dict[int, float]:
    """Per Flushed segment: the deletes of its partition that may hit it (pk range and
    bloom filter of its stats logs) over its rows: an upper estimate, as Milvus'."""
    out: dict[int, float] = {}
    paths = delete_paths_by_partition(segments)  # (one pass: most partitions have none)
    if not paths:
        return out
    by_partition: dict[int, Any] = {}
    for seg in segments:
        if seg.partition_id not in paths or not compactable(seg) or not seg.statslogs:
            continue
        if seg.partition_id not in by_partition:
            deletes = read_files(storage, paths[seg.partition_id], columns=DELETE_COLUMNS)
            by_partition[seg.partition_id] = None if deletes is None else deletes["pk"].to_numpy()
        pks = by_partition[seg.partition_id]
        if pks is None:
            continue
        hits = sum(
            int(PkStats.from_bytes(storage.read_bytes(s.path)).might_contain(pks).sum())
            for s in seg.statslogs
        )
        out[seg.id] = hits / seg.num_rows
    return out


def l0_candidates(
    segments: Sequence[Decoded[SegmentInfo]],
    busy: set[int],
    checkpoints: dict[str, int],
    min_count: int = 1,
    min_bytes: int = 0,
) -> list[Candidate]:
    """Per partition: the Flushed L0 segments at or below their channel's checkpoint,
    with every live Flushed L1 segment of the partition as a target (inputs too: the
    commit checks their versions). Skipped while a target is in another plan; an L0 segment
    waits while a segment that may hold rows older than its deletes is not Flushed yet (a
    sync still writes it: its rows would miss the deletes). Only partitions with at least
    `min_count` such L0 segments or `min_bytes` of their delta logs (the compaction check's
    thresholds; the lifecycle step takes every one).

    The oldest MAX_L0_PER_PLAN L0 segments go in one plan; when their targets do not fit in
    the same transaction, the plan takes the first of them and the rest are chained: each
    link's commit gives its targets the deletes and creates the next link, the last drops
    the L0 segments."""
    groups: dict[int, list[Decoded[SegmentInfo]]] = defaultdict(list)
    for d in segments:
        s = d.model
        if s.level is not SegmentLevel.L0:  # (most are not: checked first)
            continue
        cp = checkpoints.get(s.vchannel)
        ready = s.state is SegmentState.FLUSHED and s.deltalogs
        if ready and s.id not in busy and s.dml_position and cp is not None and s.dml_position.offset <= cp:
            groups[s.partition_id].append(d)
    out = []
    for partition, l0 in groups.items():
        same = [
            d for d in segments if d.model.partition_id == partition and d.model.level is not SegmentLevel.L0
        ]
        targets = _by_id([d for d in same if compactable(d.model)])
        # A segment a sync still writes holds only rows newer than its creation: the deletes
        # older than every such segment (1 s margin for clocks) can go now, the others wait.
        unsettled = min(
            (
                d.model.created_at
                for d in same
                if d.model.state
                in (SegmentState.GROWING, SegmentState.SEALED, SegmentState.FLUSHING, SegmentState.IMPORTING)
            ),
            default=float("inf"),
        )
        l0 = [
            d
            for d in l0
            if d.model.dml_position and _seconds(d.model.dml_position.timestamp) + 1.0 < unsettled
        ]
        if not l0 or any(d.model.id in busy for d in targets):
            continue
        delta_bytes = sum(b.size_bytes for d in l0 for b in d.model.deltalogs)
        if len(l0) < min_count and delta_bytes < min_bytes:
            continue
        l0 = _by_id(l0)[:MAX_L0_PER_PLAN]  # the oldest first; the rest next time
        first = targets[: MAX_PLAN_SEGMENTS - len(l0)]
        chained = tuple(d.model.id for d in targets[len(first) :])
        reason = f"{len(l0)} L0 segments below the checkpoint"
        if chained:
            reason += f", {len(chained)} of its {len(targets)} targets in chained plans"
        out.append(Candidate(CompactionType.L0, (*l0, *first), reason, chained))
    return out


def _seconds(ts: int) -> float:
    return physical_ms(ts) / 1000


class CompactionTrigger:
    """Turns candidates into Pending plans in etcd (output ids reserved up front)."""

    def __init__(self, system: System) -> None:
        self.store, self.storage, self.settings = system.store, system.storage, system.settings
        self.ids = IdAllocator(system.store)

    def trigger(
        self,
        collection: CollectionInfo,
        kind: CompactionType,
        manual: bool = False,
        vchannel: str | None = None,
        check: bool = False,
        segments: Collection[int] | None = None,
        flushed_before: float | None = None,
        held: Collection[int] = (),
    ) -> list[CompactionPlan]:
        """Pending plans of `kind` for the collection (only of `vchannel`'s segments if given,
        only of `segments` if given; if `flushed_before` (an epoch second) is given, no sort or
        mix of an unsorted segment flushed after it: that one waits for the stats task; no sort
        or mix of the `held` segments: their sort task failed and waits for its next try).

        `check`: the cheap compaction check between lifecycle steps: L0 compaction only of
        partitions past VCHAN_L0_COMPACTION_TRIGGER_COUNT / _MB, mix compaction only of
        small segments (the delete ratios, which read every delta log and bloom filter of
        the collection, wait for the lifecycle step)."""
        found = SegmentMeta(self.store).list(collection.id, vchannel=vchannel)
        if segments is not None:
            found = [d for d in found if d.model.id in segments]
        busy = busy_segments(list_plans(self.store))
        if kind is not CompactionType.L0:  # what their sort failed on would fail these plans too
            busy = busy | set(held)
        free = [d for d in found if d.model.id not in busy] if busy else found
        if flushed_before is not None and kind is not CompactionType.L0:  # fresh flushes: the stats task's
            free = [
                d
                for d in free
                if d.model.is_sorted or physical_ms(d.model.last_flush_ts) / 1000 < flushed_before
            ]
        max_rows = max_rows_of(collection, self.settings)
        expire_before = collection.expired_before(compose_ts(int(time.time() * 1000)))
        if kind is CompactionType.SORT:
            candidates = sort_candidates(free)
        elif kind is CompactionType.MIX:
            ratios = {} if check else delete_ratios(self.storage, [d.model for d in found])
            candidates = mix_candidates(
                free,
                max_rows,
                self.settings.compaction_small_proportion,
                ratios,
                self.settings.compaction_delete_ratio,
                manual,
                self.settings.compaction_tier_factor,
                expired_ratios((d.model for d in free), expire_before),  # (no pass without a TTL)
            )
        else:
            checkpoints = {v: channel_checkpoint(self.store, v) for v in collection.vchannels}
            offsets = {v: cp.model.offset for v, cp in checkpoints.items() if cp is not None}
            if check:
                count, mb = self.settings.l0_compaction_trigger_count, self.settings.l0_compaction_trigger_mb
                candidates = l0_candidates(found, busy, offsets, count, int(mb * 2**20))
            else:
                candidates = l0_candidates(found, busy, offsets)
        return [self._plan(collection, c, max_rows, expire_before) for c in candidates]

    def _plan(
        self, collection: CollectionInfo, c: Candidate, max_rows: int, expire_before: int = 0
    ) -> CompactionPlan:
        rows = sum(d.model.num_rows for d in c.segments)
        n_out = 0 if c.type is CompactionType.L0 else outputs_needed(rows, max_rows)
        first = c.segments[0].model
        first_output = self.ids.alloc(n_out) if n_out else 0
        plan = CompactionPlan(
            plan_id=self.ids.alloc(),
            type=c.type,
            collection_id=collection.id,
            partition_id=first.partition_id,
            vchannel=first.vchannel,
            inputs=tuple(PlanInput(d.model.id, d.kv.version) for d in c.segments),
            output_ids=tuple(range(first_output, first_output + n_out)),
            reason=c.reason,
            created_at=time.time(),
            chained=c.chained,
            expire_before=0 if c.type is CompactionType.L0 else expire_before,
        )
        create_plan(self.store, plan)
        log.info(
            "planned %s compaction %d of segments %s (%s)", c.type, plan.plan_id, plan.input_ids, c.reason
        )
        return plan


# --- executor ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanOutcome:
    plan_id: int
    state: PlanState
    reason: str = ""
    outputs: tuple[int, ...] = ()
    next_link: int = 0  # a chained L0 plan: the plan its commit created (0: none)


def input_memory_mb(segments: Sequence[SegmentInfo]) -> float:
    return COMPACTION_MEMORY_FACTOR * sum(b.size_bytes for s in segments for b in s.binlog_files) / 2**20


def compaction_memory_mb(spec: CompactionSpec) -> float:
    """A plan's memory estimate: its inputs (and an L0 plan's targets) read and rewritten."""
    return input_memory_mb([*spec.inputs, *spec.targets])


class CompactionExecutor:
    """Runs Pending plans: every plan's task in one Spark job (or in-process), the plans
    admitted by their memory estimates against VCHAN_TASK_MEMORY_MB (`memory_batches`):
    what does not fit runs in the next job. `jobs`: the plan ids of each job run."""

    def __init__(self, system: System, engine: Engine = "spark", timeout: float = 600.0) -> None:
        self.store, self.storage, self.settings = system.store, system.storage, system.settings
        self.engine, self.timeout = engine, timeout
        self.ids = IdAllocator(system.store)
        self.collections = CollectionRegistry(system.store)
        self.applied_ts: dict[int, int] = {}  # plan id -> newest delete its task may apply
        self.jobs: list[list[int]] = []

    def run_pending(self, plan_ids: Sequence[int] | None = None) -> list[PlanOutcome]:
        """Run the Pending plans (those of `plan_ids` if given), then the links their
        commits chained, round after round."""
        latest = self._run_round(plan_ids)
        outcomes = list(latest)
        while links := [o.next_link for o in latest if o.next_link]:
            latest = self._run_round(links)
            outcomes += latest
        return outcomes

    def _run_round(self, plan_ids: Sequence[int] | None) -> list[PlanOutcome]:
        pending = [
            d
            for d in list_plans(self.store)
            if d.model.state is PlanState.PENDING and (plan_ids is None or d.model.plan_id in plan_ids)
        ]
        started: list[tuple[Decoded[CompactionPlan], CompactionSpec]] = []
        outcomes = []
        for d in pending:
            ready = self.start(d)
            if isinstance(ready, PlanOutcome):
                outcomes.append(ready)
            elif ready is not None:
                started.append(ready)
        budget = self.settings.task_memory_mb
        for batch in memory_batches(started, lambda s: compaction_memory_mb(s[1]), budget):
            self.jobs.append([spec.plan_id for _, spec in batch])
            results = self._run([spec for _, spec in batch])
            for (plan, _spec), result in zip(batch, results, strict=True):
                outcomes.append(self.finish(plan, result))
        return outcomes

    def start(
        self, plan: Decoded[CompactionPlan]
    ) -> tuple[Decoded[CompactionPlan], CompactionSpec] | PlanOutcome | None:
        """Pending -> Executing and the task's spec; a plan whose inputs changed fails."""
        executing = transition(
            self.store, plan, state=PlanState.EXECUTING, started_at=time.time(), worker=worker_of(self.store)
        )
        if executing is None:
            return None  # another executor took it
        p = executing.model
        try:
            inputs = read_inputs(self.store, p)
        except CompactionConflictError as exc:
            return self.fail(executing, str(exc))
        l0 = tuple(s for s in inputs if s.level is SegmentLevel.L0)
        bad = [s.id for s in inputs if not compactable(s) and not (p.type is CompactionType.L0 and s in l0)]
        if bad:
            return self.fail(executing, f"segments {bad} are not Flushed L1 segments with rows")
        info = self.collections.get(p.collection_id, include_dropped=True)
        found = SegmentMeta(self.store).list(p.collection_id)
        spec = CompactionSpec(
            plan_id=p.plan_id,
            storage=self.storage,
            schema=info.schema,
            inputs=tuple(inputs),
            delete_paths=tuple(delete_paths([d.model for d in found], p.partition_id)),
            output_ids=p.output_ids,
            log_id_base=self.ids.alloc(LOG_IDS_PER_PLAN),
            max_rows=max_rows_of(info, self.settings),
            expire_before=p.expire_before,
        )
        if p.type is CompactionType.L0:
            spec = replace(spec, inputs=l0, targets=tuple(s for s in inputs if s not in l0))
        # The newest delete the outputs may apply: what the commit stamps the inputs with.
        paths = {*spec.delete_paths, *(b.path for s in l0 for b in s.deltalogs)}
        self.applied_ts[p.plan_id] = max(
            (b.ts_to for d in found for b in d.model.deltalogs if b.path in paths), default=0
        )
        return executing, spec

    def _run(self, specs: list[CompactionSpec]) -> list[CompactionOutput | CompactionInputError]:
        if not specs:
            return []
        if self.engine == "local":
            return [outcome_of(run_pickled(spec)) for spec in specs]
        return _run_on_spark(self.settings, specs, self.timeout)

    def finish(
        self, plan: Decoded[CompactionPlan], result: CompactionOutput | CompactionInputError
    ) -> PlanOutcome:
        if isinstance(result, CompactionInputError):
            log.error("%s", result)
            return self.fail(plan, str(result))
        failpoint("compaction_after_files")
        rows_out = sum(s.num_rows for s in result.segments)
        kept, then = self._next_link(plan.model, result.changed)
        try:
            commit_compaction(
                self.store,
                plan,
                result.segments,
                changed_inputs=result.changed,
                kept=kept,
                then=then,
                applied_ts=self.applied_ts.pop(plan.model.plan_id, None),
                rows_in=result.rows_in,
                rows_out=rows_out,
                bytes_in=result.bytes_in,
                bytes_out=sum(b.size_bytes for s in result.segments for b in s.binlog_files),
                deletes_applied=result.deletes_applied,
            )
        except CompactionConflictError as exc:
            log.warning("%s", exc)
            return self.fail(plan, str(exc))
        except MetaUnavailableError:
            raise  # the commit may have happened: the plan times out, or the next step sees it
        except MetaError as exc:  # etcd refused the transaction: nothing was written
            log.error("compaction %d: %s", plan.model.plan_id, exc)
            return self.fail(plan, f"commit refused: {exc}")
        failpoint("compaction_after_commit")
        log.info(
            "compaction %d (%s): %d rows in, %d out, segments %s -> %s",
            plan.model.plan_id,
            plan.model.type,
            result.rows_in,
            rows_out,
            plan.model.input_ids,
            [s.id for s in result.segments],
        )
        failpoint("compaction_before_cleanup")
        cleanup_plan(self.store, plan.model.plan_id)
        return PlanOutcome(
            plan.model.plan_id,
            PlanState.COMPLETED,
            outputs=tuple(s.id for s in result.segments),
            next_link=then.plan_id if then else 0,
        )

    def _next_link(
        self, plan: CompactionPlan, targets: Sequence[SegmentInfo]
    ) -> tuple[set[int], CompactionPlan | None]:
        """A chained L0 plan: its L0 inputs, kept live by its commit, and the next link (the
        same L0 inputs at the same versions, the next targets still live). Nothing to keep
        and no link for any other plan, or when no chained target is left."""
        if plan.type is not CompactionType.L0 or not plan.chained:
            return set(), None
        done = {t.id for t in targets}
        l0 = tuple(i for i in plan.inputs if i.segment_id not in done)
        found = SegmentMeta(self.store).list(plan.collection_id)
        live = {d.model.id: d for d in found if compactable(d.model)}  # one listing, not a get per target
        rest = [PlanInput(i, live[i].kv.version) for i in plan.chained if i in live]
        if not rest:
            return set(), None
        first = rest[: MAX_PLAN_SEGMENTS - len(l0)]
        then = replace(
            plan,
            plan_id=self.ids.alloc(),
            inputs=(*l0, *first),
            chained=tuple(i.segment_id for i in rest[len(first) :]),
            state=PlanState.PENDING,
            reason=f"chained after plan {plan.plan_id}: {len(rest)} targets left",
            created_at=time.time(),
            started_at=0.0,
        )
        return {i.segment_id for i in l0}, then

    def fail(self, plan: Decoded[CompactionPlan], reason: str) -> PlanOutcome:
        """The plan failed: its inputs stay live, its files are orphans for GC."""
        transition(self.store, plan, state=PlanState.FAILED, reason=reason, finished_at=time.time())
        return PlanOutcome(plan.model.plan_id, PlanState.FAILED, reason)


def cleanup_plan(store: MetaStore, plan_id: int) -> bool:
    """A Completed or Failed plan -> Cleaned: it no longer reserves its output segments."""
    found = store.get_model(store.keys.compaction_plan(plan_id), CompactionPlan)
    if found is None or found.model.state not in (PlanState.COMPLETED, PlanState.FAILED):
        return False
    return transition(store, found, state=PlanState.CLEANED) is not None


def _run_on_spark(
    settings: Settings, specs: list[CompactionSpec], timeout: float
) -> list[CompactionOutput | CompactionInputError]:
    from vchan_assets.spark.session import get_spark, run_arrow_tasks

    spark = get_spark(settings)
    description = f"compaction of {len(specs)} plans"
    rows = run_arrow_tasks(spark, run_compactions_arrow, specs, RESULT_SCHEMA, description, timeout)
    by_plan = {r["plan_id"]: outcome_of(r.asDict()) for r in rows}
    return [by_plan[s.plan_id] for s in specs]
