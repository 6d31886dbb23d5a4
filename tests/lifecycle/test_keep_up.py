"""Compaction that keeps up with ingest: L0 compaction chained over several plans when one
etcd transaction cannot hold every target of a partition (and a crash between two links),
and the compaction check that triggers L0 and mix compaction by thresholds between
lifecycle steps."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.lifecycle import compaction
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionType, PlanState, list_plans
from vchan_assets.lifecycle.step import compaction_check
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentLevel
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, cli_env
from vchan_assets.testing.steps import (
    assert_lifecycle_invariants,
    flushed_batches,
    live,
    live_l1,
    start_datacoord,
)
from vchan_assets.wal.producer import Producer

# A plan of at most 8 segments, 2 of them L0, on an etcd taking 16 operations per
# transaction: 20 targets cannot go in one commit with their L0 segments (at most 6 can;
# the last link moves its 2 L0 segments to the dropped family, 3 operations each).
SMALL_PLAN = {"MAX_PLAN_SEGMENTS": 8, "MAX_L0_PER_PLAN": 2}
CHILD = f"""
from vchan_assets.config import Settings
from vchan_assets.lifecycle import compaction
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System
for name, value in {SMALL_PLAN!r}.items():
    setattr(compaction, name, value)
settings = Settings.from_env()
system = System(settings, MetaStore.connect(settings), Storage.from_settings(settings))
for info in compaction.CollectionRegistry(system.store).list():
    compaction.CompactionTrigger(system).trigger(info, compaction.CompactionType.L0)
compaction.CompactionExecutor(system, "local").run_pending()
"""


@pytest.fixture
def small_txn(settings: Settings, tmp_path: Path) -> Iterator[tuple[Settings, MetaStore]]:
    server = EmbeddedEtcd(tmp_path / "small-txn-etcd", max_txn_ops=16).start()
    small = replace(settings, etcd_endpoints=(server.endpoint,))
    store = MetaStore.connect(small)
    try:
        yield small, store
    finally:
        store.close()
        server.stop()


@pytest.fixture
def small_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SMALL_PLAN.items():
        monkeypatch.setattr(compaction, name, value)


@pytest.fixture
def small_txn_collection(
    small_txn: tuple[Settings, MetaStore], storage: Storage, small_plans: None
) -> tuple[System, Producer, CollectionInfo]:
    """A collection of one vchannel on the small-transaction etcd, plans small to match."""
    system = System(*small_txn, storage)
    producer = Producer(system)
    return system, producer, producer.create_collection("c", SCHEMA, num_channels=1)


def l0_left(store: MetaStore, info: CollectionInfo) -> list[int]:
    return [s.id for s in live(store, info) if s.level is SegmentLevel.L0]


def test_l0_deletes_reach_more_targets_than_one_transaction_holds_through_chained_plans(
    small_txn_collection: tuple[System, Producer, CollectionInfo],
) -> None:
    system, producer, info = small_txn_collection
    store = system.store
    # 20 rounds: 20 small L1 segments (the targets) and 20 L0 segments, each deleting 2 rows
    # of its round's segment.
    produced = flushed_batches(system, producer, info, batches=20, rows=20, deletes=2)
    targets = {s.id for s in live_l1(store, info)}
    for _ in range(10):
        for plan in CompactionTrigger(system).trigger(info, CompactionType.L0):
            assert len(plan.inputs) <= 8 and plan.chained  # the other targets in later links
        outcomes = CompactionExecutor(system, "local").run_pending()
        assert all(o.state is PlanState.COMPLETED for o in outcomes), outcomes
    assert not l0_left(store, info)
    plans = [d.model for d in list_plans(store)]
    links = [p for p in plans if p.reason.startswith("chained after plan")]
    assert len(links) >= 10 * 3, [p.reason for p in plans]  # every pair of L0 segments: 4 links
    assert {s.id for s in live_l1(store, info)} == targets  # L0 compaction rewrites no rows
    assert_lifecycle_invariants(system, info, produced)


def test_compactor_killed_between_two_links_leaves_the_next_link_pending_and_it_finishes_the_chain(
    small_txn_collection: tuple[System, Producer, CollectionInfo],
) -> None:
    system, producer, info = small_txn_collection
    settings, store = system.settings, system.store
    produced = flushed_batches(system, producer, info, batches=12, rows=20, deletes=2)
    l0 = l0_left(store, info)
    env = cli_env(settings, VCHAN_FAILPOINT="compaction_after_commit")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # killed right after the first commit
    states = {d.model.state for d in list_plans(store)}
    assert states == {PlanState.COMPLETED, PlanState.PENDING}, states  # link 1 done, link 2 written with it
    assert set(l0) <= set(l0_left(store, info))  # the L0 segments stay live until the last link
    assert_lifecycle_invariants(system, info, produced)
    CompactionExecutor(system, "local").run_pending()  # the next executor finishes the chain
    assert set(l0_left(store, info)) == set(l0) - set(sorted(l0)[:2])  # the oldest 2 went
    assert_lifecycle_invariants(system, info, produced)


def test_the_compaction_check_runs_l0_compaction_only_past_the_count_threshold(
    system: System, store: MetaStore, producer: Producer
) -> None:
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    system = replace(
        system,
        settings=replace(system.settings, l0_compaction_trigger_count=3, l0_compaction_trigger_mb=64.0),
    )
    produced = flushed_batches(system, producer, info, batches=2, rows=40, deletes=3)
    compaction_check(system, "local")
    assert len(live_l1(store, info)) == 1  # the two small segments merged (mix)...
    assert len(l0_left(store, info)) == 2  # ...but 2 L0 segments are below the threshold of 3
    more = flushed_batches(system, producer, info, batches=1, rows=40, deletes=3, first_batch=2)
    produced.rows += more.rows
    produced.deleted += more.deleted
    report = compaction_check(system, "local")
    assert all(o.state is PlanState.COMPLETED for o in report.outcomes), report.outcomes
    assert not l0_left(store, info)
    assert_lifecycle_invariants(system, info, produced)


def test_datacoord_process_compacts_l0_segments_between_lifecycle_steps(
    system: System, store: MetaStore, settings: Settings, producer: Producer
) -> None:
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    proc = start_datacoord(
        settings,
        VCHAN_LIFECYCLE_INTERVAL="3600",
        VCHAN_COMPACTION_CHECK_INTERVAL="0.5",
        VCHAN_L0_COMPACTION_TRIGGER_COUNT="3",
    )
    try:
        produced = flushed_batches(system, producer, info, batches=4, rows=40, deletes=3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and l0_left(store, info):
            time.sleep(0.3)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert not l0_left(store, info), out.decode()[-3000:]
    assert_lifecycle_invariants(system, info, produced)
