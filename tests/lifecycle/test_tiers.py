"""Mix compaction triggers: size-tiered merging (a merged segment is not rewritten at
every step, only once the newer segments have grown to its size) and the delete ratio
(a segment many deletes hit is rewritten without them, its bytes reclaimed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
from vchan_assets.lifecycle.plans import CompactionType, PlanState
from vchan_assets.lifecycle.step import lifecycle_step
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced
from vchan_assets.testing.steps import assert_lifecycle_invariants, flushed_batches, live, live_l1
from vchan_assets.wal.producer import Producer


def test_a_merged_segment_waits_until_newer_ones_reach_its_size_tier(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()

    def round_then_step(batches: int = 1) -> list[tuple[int, int]]:
        """(rows, segment id) of the live segments, smallest first, after a lifecycle step."""
        more = flushed_batches(system, producer, collection, batches=batches, first_batch=len(produced.rows))
        produced.rows += more.rows
        produced.deleted += more.deleted
        report = lifecycle_step(system, engine="local", collect=False)
        assert all(o.state is PlanState.COMPLETED for o in report.outcomes), report.outcomes
        return sorted((s.num_rows, s.id) for s in live_l1(store, collection))

    [(merged, big)] = round_then_step(3)  # three rounds of 200 rows, 10 of each deleted
    assert merged == 570
    # One new segment per step: the merged one is not rewritten while the newer ones are
    # below half its size; they merge among themselves (190 + 190; 200 + 380).
    for expected in ([190, 570], [380, 570], [570, 570]):
        now = round_then_step()
        assert [rows for rows, _ in now] == expected
        assert big in [seg for _, seg in now], "the merged segment was rewritten"
    # Its tier is full now: the two 570-row segments merge (and the new one is sorted).
    now = round_then_step()
    assert [rows for rows, _ in now] == [190, 1140]
    [grown] = [s for s in live_l1(store, collection) if s.num_rows == 1140]
    assert big in grown.compaction_from
    assert_lifecycle_invariants(system, collection, produced)


def test_a_segment_many_deletes_hit_is_rewritten_alone_and_its_bytes_reclaimed(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    produced = flushed_batches(system, producer, collection, batches=3, deletes=0)
    lifecycle_step(system, engine="local", collect=False)
    [big] = live_l1(store, collection)
    # 30% of its rows deleted; a new small segment beside it (its own tier: not merged)
    doomed = list(range(10_000, 10_180))
    producer.delete(collection.name, doomed, partition="_default")
    produced.deleted += doomed
    more = flushed_batches(system, producer, collection, batches=1, first_batch=5, deletes=0)
    produced.rows += more.rows
    report = lifecycle_step(system, engine="local", collect=False)
    assert all(o.state is PlanState.COMPLETED for o in report.outcomes), report.outcomes
    [rewritten] = [s for s in live_l1(store, collection) if big.id in s.compaction_from]
    assert rewritten.compaction_from == (big.id,), "rewritten alone"
    assert rewritten.num_rows == big.num_rows - len(doomed)

    def stored(seg: SegmentInfo) -> int:
        return sum(b.size_bytes for b in seg.binlog_files)

    assert stored(rewritten) < 0.8 * stored(big)
    assert_lifecycle_invariants(system, collection, produced)


def test_many_l0_and_small_segments_are_compacted_in_plans_small_enough_for_one_etcd_transaction(
    system: System, store: MetaStore, producer: Producer, collection: CollectionInfo
) -> None:
    # 70 rounds: 70 L0 segments and 70 small L1 targets; one commit of all of them would
    # write ~140 keys, over etcd's 128 operations per transaction.
    produced = flushed_batches(system, producer, collection, batches=70, rows=20, deletes=2)
    for _ in range(4):
        report = lifecycle_step(system, engine="local", collect=False)
        assert all(o.state is PlanState.COMPLETED for o in report.outcomes), report.outcomes
    left = [s for s in live(store, collection) if s.level is SegmentLevel.L0]
    assert not left, f"{len(left)} L0 segments left"
    assert len(live_l1(store, collection)) <= 3
    assert_lifecycle_invariants(system, collection, produced)


def test_a_commit_etcd_refuses_fails_its_plan_and_leaves_the_inputs_live(
    settings: Settings, storage: Storage, tmp_path: Path
) -> None:
    # an etcd taking at most 8 operations per transaction; a merge of 8 segments needs 10
    server = EmbeddedEtcd(tmp_path / "small-txn-etcd", max_txn_ops=8).start()
    settings = replace(settings, etcd_endpoints=(server.endpoint,))
    store = MetaStore.connect(settings)
    try:
        system = System(settings, store, storage)
        producer = Producer(system)
        info = producer.create_collection("c", SCHEMA, num_channels=1)
        produced = flushed_batches(system, producer, info, batches=8, rows=20, deletes=0)
        before = {s.id for s in live_l1(store, info)}
        CompactionTrigger(system).trigger(info, CompactionType.MIX, manual=True)
        [outcome] = CompactionExecutor(system, "local").run_pending()
        assert outcome.state is PlanState.FAILED and "commit refused" in outcome.reason
        assert {s.id for s in live_l1(store, info)} == before
        assert_lifecycle_invariants(system, info, produced)
    finally:
        store.close()
        server.stop()
