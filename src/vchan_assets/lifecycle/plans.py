"""Compaction plans in etcd (`{root}/meta/compaction/{planID}`) and their one commit.

A plan names its type (sort, l0, mix), its input segments with the etcd version each
had when planned, the segment ids reserved for its outputs, and its state:

    Pending --start--> Executing --commit--> Completed --cleanup--> Cleaned (deleted later)
       |                   +--fail (conflict, bad input, worker gone, timeout)--> Failed --cleanup--+

An Executing plan names its worker (process and DataCoord term): when that term ends or
that process exits, the next lifecycle step or sort task fails and cleans it at once
(`release_orphaned_plans`), so its segments are free for new plans within seconds of a
crash rather than VCHAN_COMPACTION_TIMEOUT later.

`commit_compaction` is the only way a compaction changes segment meta: in ONE etcd
transaction it compares every input's version (and the plan's), adds the outputs (each
with its vchannel's index entry), marks the inputs Dropped and the plan Completed. A
concurrent change of any input (a sync, a flush, another plan, a GC) makes it fail whole;
the outputs' files are then orphans for garbage collection. So a crash at any step leaves either the inputs or the
outputs live, never both.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from vchan_assets.datacoord import segment_ops
from vchan_assets.errors import DeclaredError
from vchan_assets.meta.allocator import timestamp_ceiling
from vchan_assets.meta.errors import CasConflictError, MetaError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import Record, SegmentInfo


class CompactionType(enum.StrEnum):
    SORT = "sort"  # the stats task: one Flushed segment rewritten sorted by pk
    L0 = "l0"  # deletes of L0 segments moved into the segments that hold their pks
    MIX = "mix"  # small segments merged, deleted rows removed


class PlanState(enum.StrEnum):
    PENDING = "Pending"
    EXECUTING = "Executing"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CLEANED = "Cleaned"


ACTIVE = (PlanState.PENDING, PlanState.EXECUTING)
FINISHED = (PlanState.COMPLETED, PlanState.FAILED)


@dataclass(frozen=True)
class PlanInput(Record):
    segment_id: int
    version: int  # etcd version of the segment meta when planned


@dataclass(frozen=True)
class CompactionPlan(Record):
    plan_id: int
    type: CompactionType
    collection_id: int
    partition_id: int
    vchannel: str
    inputs: tuple[PlanInput, ...]
    output_ids: tuple[int, ...] = ()  # reserved: GC leaves these segments' files alone
    state: PlanState = PlanState.PENDING
    reason: str = ""  # why it was triggered, then why it failed
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    rows_in: int = 0
    rows_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    # The delta logs the compaction applied (set at commit; None on plans written before):
    # what the rows check recomputes with, not deletes synced since.
    deletes_applied: tuple[str, ...] | None = None
    # L0 compaction chained over several plans (one transaction cannot hold every target of
    # a partition): the targets later links will give these deletes to. Reserved like inputs;
    # this link's commit keeps the L0 inputs live and creates the next link.
    chained: tuple[int, ...] = ()
    # Who executes it (`datacoord.tasks.worker_of`: `host:pid@term`), set when it starts:
    # once that worker is gone the plan is failed at once, not at VCHAN_COMPACTION_TIMEOUT
    # ("" on plans written before: only the timeout ends those).
    worker: str = ""
    # A collection with a TTL: rows inserted before this timestamp had expired when the plan
    # was made; a sort or mix drops them (0: none, as on plans written before).
    expire_before: int = 0

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"deletes_applied"})
    OMIT_WHEN_DEFAULT: ClassVar[frozenset[str]] = frozenset({"expire_before"})

    @property
    def input_ids(self) -> tuple[int, ...]:
        return tuple(i.segment_id for i in self.inputs)

    @property
    def reserved(self) -> tuple[int, ...]:
        """Every segment the plan holds while active: its inputs, its outputs, the targets
        of its later links."""
        return (*self.input_ids, *self.output_ids, *self.chained)

    def validate(self) -> None:
        if not self.inputs:
            raise ValueError("a compaction plan needs at least one input segment")


class CompactionConflictError(DeclaredError, MetaError):
    """The commit found an input changed since it was planned: nothing was written."""

    plan_id: int
    key: str
    detail: str
    message = "compaction plan {plan_id}: {key} {detail}; the plan is aborted"


def list_plans(store: MetaStore) -> list[Decoded[CompactionPlan]]:
    found, _ = store.list_models(store.keys.compaction_plan.prefix, CompactionPlan)
    return sorted(found, key=lambda d: d.model.plan_id)


def busy_segments(plans: Sequence[Decoded[CompactionPlan]]) -> set[int]:
    """Segments an active plan reads or will write: no other plan may take them."""
    return {seg for d in plans if d.model.state in ACTIVE for seg in d.model.reserved}


def create_plan(store: MetaStore, plan: CompactionPlan) -> Decoded[CompactionPlan]:
    key = store.keys.compaction_plan(plan.plan_id)
    store.cas(key, 0, plan)
    found = store.get_model(key, CompactionPlan)
    assert found is not None
    return found


def transition(
    store: MetaStore, plan: Decoded[CompactionPlan], **changes: Any
) -> Decoded[CompactionPlan] | None:
    """Change a plan if nobody else did since `plan` was read; None if someone did."""
    updated = replace(plan.model, **changes)
    try:
        store.cas(plan.kv.key, plan.kv.version, updated)
    except CasConflictError:
        return None
    found = store.get_model(plan.kv.key, CompactionPlan)
    return found


def segment_key(store: MetaStore, plan: CompactionPlan, segment_id: int) -> str:
    return store.keys.segment(plan.collection_id, plan.partition_id, segment_id)


def read_inputs(store: MetaStore, plan: CompactionPlan) -> list[SegmentInfo]:
    """The inputs as planned; CompactionConflictError if one changed or disappeared."""
    out = []
    for inp in plan.inputs:
        key = segment_key(store, plan, inp.segment_id)
        found = store.get_model(key, SegmentInfo)
        version = found.kv.version if found else 0
        if version != inp.version or found is None:
            raise CompactionConflictError(
                plan.plan_id, key, f"is at version {version}, planned at {inp.version}"
            )
        out.append(found.model)
    return out


def commit_compaction(
    store: MetaStore,
    plan: Decoded[CompactionPlan],
    outputs: Sequence[SegmentInfo],
    changed_inputs: Sequence[SegmentInfo] = (),
    kept: Collection[int] = (),
    then: CompactionPlan | None = None,
    applied_ts: int | None = None,
    **plan_changes: Any,
) -> int:
    """One transaction: every input still at its planned version and the plan unchanged,
    then the outputs added, the inputs Dropped (or replaced by `changed_inputs`, the L0
    targets that gained delta logs; or left as they are if `kept`: the L0 inputs of a chained
    link), the next link `then` created, and the plan Completed. Returns the revision;
    CompactionConflictError naming the changed key otherwise (nothing written).

    The dropped inputs are stamped `dropped_ts`: a read at a timestamp below it serves them
    instead of the outputs (`query.asof.segments_at`), since the outputs lack rows that
    deletes after that timestamp removed. `applied_ts` is the newest timestamp of the deletes
    the outputs applied (the executor knows them); without it, the oracles' ceiling, above
    every timestamp issued so far."""
    p = plan.model
    inputs = {s.id: s for s in read_inputs(store, p)}
    now = time.time()
    # At or above every delete the outputs applied; 1 when they applied none (any read may
    # serve the outputs: they hold the same rows).
    stamp = max(applied_ts, 1) if applied_ts is not None else timestamp_ceiling(store)
    puts: dict[str, Any] = {}
    deletes: list[str] = []
    door = SegmentMeta(store)
    changed = {seg.id for seg in changed_inputs}
    writes = [*changed_inputs]
    for seg in inputs.values():
        if seg.id in kept or seg.id in changed:
            continue  # kept: a chained link's L0 inputs, compared and left as they are
        dropped = segment_ops.drop(seg)
        writes.append(replace(dropped, dropped_ts=stamp) if dropped else seg)
    for seg in writes:
        written, gone = door.writes(seg)  # a Dropped input leaves the live family
        puts.update(written)
        deletes += gone
    expect = {segment_key(store, p, i.segment_id): i.version for i in p.inputs}
    for seg in outputs:
        puts.update(door.create_puts(seg))  # its meta and its vchannel's index entry
        expect[door.key(seg)] = 0
    if then is not None:
        puts[store.keys.compaction_plan(then.plan_id)] = then
        expect[store.keys.compaction_plan(then.plan_id)] = 0
    expect[plan.kv.key] = plan.kv.version
    puts[plan.kv.key] = replace(p, state=PlanState.COMPLETED, finished_at=now, **plan_changes)
    revision = store.txn(expect, puts, deletes)
    if revision is None:
        raise _conflict(store, plan, expect)
    return revision


def _conflict(
    store: MetaStore, plan: Decoded[CompactionPlan], expect: dict[str, int]
) -> CompactionConflictError:
    for key, version in expect.items():
        found = store.get(key)
        now = found.version if found else 0
        if now != version:
            return CompactionConflictError(
                plan.model.plan_id, key, f"is at version {now}, expected {version}"
            )
    return CompactionConflictError(plan.model.plan_id, plan.kv.key, "changed during the commit")
