"""Crash safety: `vchan compact` and `vchan gc` SIGKILLed at each commit step (the
failpoints), then the DataCoord lifecycle step and GC recover: every live row in exactly
one live segment, every delete still applied, no live meta naming a missing file."""

from __future__ import annotations

import signal
import time
from dataclasses import replace

import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import list_orphans
from vchan_assets.lifecycle.gc import GarbageCollector
from vchan_assets.lifecycle.plans import PlanState, list_plans
from vchan_assets.lifecycle.step import lifecycle_step
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.steps import assert_lifecycle_invariants, flushed_batches, live_l1, run_vchan
from vchan_assets.wal.producer import Producer


def recover(store: MetaStore, storage: Storage, settings: Settings) -> None:
    """What the DataCoord does next: time out the dead executor's plan, clean up, GC."""
    quick = replace(settings, compaction_timeout=0.001, gc_missing_tolerance=1.0, gc_drop_tolerance=1.0)
    time.sleep(0.01)
    lifecycle_step(System(quick, store, storage), engine="local", compact=False, collect=False)
    GarbageCollector(System(quick, store, storage), clock=lambda: time.time() + 5).run()


STEPS = ["compaction_after_files", "compaction_after_commit", "compaction_before_cleanup"]


@pytest.mark.parametrize("kind", ["sort", "mix"])
@pytest.mark.parametrize("step", STEPS)
def test_compaction_killed_at_a_commit_step_leaves_inputs_or_outputs_live_never_both(
    system: System, step: str, kind: str, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    before = {s.id for s in live_l1(store, collection)}
    crashed = run_vchan(
        system.settings,
        "compact",
        "--collection",
        collection.name,
        "--type",
        kind,
        "--wait",
        "--engine",
        "local",
        VCHAN_FAILPOINT=step,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    after = {s.id for s in live_l1(store, collection)}
    plans = [d.model for d in list_plans(store) if d.model.collection_id == collection.id]
    assert len(plans) == (2 if kind == "sort" else 1)  # a sort plan per segment, one merge
    for p in plans:  # each plan's inputs or its outputs are live, never both, never neither
        assert bool(after & set(p.input_ids)) != bool(after & set(p.output_ids)), (p, after)
    door = SegmentMeta(store)
    for p in plans:  # each input in exactly one family: the commit moved it, or nothing did
        for i in p.input_ids:
            seg = door.get(collection.id, p.partition_id, i, include_dropped=True)
            assert seg is not None
            where = (
                store.get(door.key(seg.model)) is not None,
                store.get(door.dropped_key(seg.model)) is not None,
            )
            assert where == ((True, False) if i in after else (False, True)), (i, where)
    assert after == before if step == "compaction_after_files" else after != before
    assert_lifecycle_invariants(system, collection, produced)
    recover(store, system.storage, system.settings)
    assert all(d.model.state is PlanState.CLEANED for d in list_plans(store))
    assert_lifecycle_invariants(system, collection, produced)
    assert not list_orphans(store, system.storage), "the dead compaction's files are collected"


def test_gc_killed_between_files_and_meta_finishes_on_the_next_pass(
    system: System, store: MetaStore, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    done = run_vchan(settings, "compact", "--collection", collection.name, "--wait", "--engine", "local")
    assert done.returncode == 0, done.stderr
    dropped = {s.id for s in segments(store, collection) if s.state is SegmentState.DROPPED and s.binlogs}
    time.sleep(0.05)
    crashed = run_vchan(
        settings,
        "gc",
        "--once",
        VCHAN_FAILPOINT="gc_after_files",
        VCHAN_GC_DROP_TOLERANCE="0.01",
        VCHAN_GC_MISSING_TOLERANCE="0.01",
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert_lifecycle_invariants(system, collection, produced)
    recover(store, system.storage, settings)
    assert not dropped & {s.id for s in segments(store, collection)}
    assert_lifecycle_invariants(system, collection, produced)


@pytest.mark.parametrize("step", STEPS)
def test_l0_compaction_killed_at_a_commit_step_keeps_every_delete_applied(
    system: System, step: str, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=2)
    crashed = run_vchan(
        system.settings, "compact", "--collection", collection.name, "--type", "l0", "--wait", "--engine", "local",
        VCHAN_FAILPOINT=step,
    )  # fmt: skip
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    l0_live = [
        s for s in segments(store, collection) if s.level.value == "L0" and s.state is SegmentState.FLUSHED
    ]
    assert bool(l0_live) == (step == "compaction_after_files")
    assert_lifecycle_invariants(system, collection, produced)
    recover(store, system.storage, system.settings)
    assert_lifecycle_invariants(system, collection, produced)
    assert not list_orphans(store, system.storage)
