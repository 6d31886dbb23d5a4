"""The segment lifecycle assets, materialized with Dagster's `materialize` on an ephemeral
instance, compaction running through Spark Connect, against a real etcd and real files."""

from __future__ import annotations

import argparse
import time
import uuid
from dataclasses import replace
from typing import Any

import dagster as dg
import pytest

from vchan_assets.cli.lifecycle import tasks as vchan_tasks
from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import DataCoordinator
from vchan_assets.datacoord.tasks import TaskSpec, enqueue_tasks, list_tasks
from vchan_assets.defs.indexes.assets import index_sensor
from vchan_assets.defs.lifecycle.assets import (
    COMPACTED_SEGMENTS,
    GARBAGE_COLLECTION,
    SORTED_SEGMENTS,
    lifecycle_sensor,
    segment_lifecycle,
    sort_job,
    sort_sensor,
    sorted_segments,
)
from vchan_assets.defs.partitions import VchannelsConfig
from vchan_assets.defs.resources import VchanResource
from vchan_assets.lifecycle.plans import CompactionPlan, CompactionType, PlanState
from vchan_assets.lifecycle.step import lifecycle_step, sort_step
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, TaskRecord, TaskState
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA
from vchan_assets.testing.steps import assert_lifecycle_invariants, flushed_batches, live_l1
from vchan_assets.wal.producer import Producer

from .helpers import evaluate, skip_message


def test_lifecycle_step_materializes_compacted_segments_and_gc_with_passing_checks(
    system: System, instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, producer: Producer
) -> None:
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    produced = flushed_batches(system, producer, info, batches=3)
    sort_step(system)  # the sort sensor's (fresh flushes are not the lifecycle step's)
    # tasks left of the segments the step merges (as a Failed one would be): deleted by the step
    enqueue_tasks(store, "sort", [TaskSpec.of(s, 1.0) for s in live_l1(store, info)])
    result = dg.materialize([segment_lifecycle], instance=instance, resources={"vchan": vchan})
    assert result.success
    by_asset = {m.asset_key: m.metadata for m in result.asset_materializations_for_node("segment_lifecycle")}
    assert by_asset[COMPACTED_SEGMENTS]["completed"].value >= 1
    assert by_asset[COMPACTED_SEGMENTS]["tasks_pruned"].value == 3 and not list_tasks(store)
    assert by_asset[COMPACTED_SEGMENTS]["binlog_files"].value > 0
    assert by_asset[GARBAGE_COLLECTION]["ran"].value is True
    checks = result.get_asset_check_evaluations()
    assert len(checks) == 3 and all(c.passed for c in checks), [c.description for c in checks]
    [merged] = live_l1(store, info)
    assert merged.is_sorted and len(merged.compaction_from) == 3
    assert_lifecycle_invariants(system, info, produced)


def test_a_fresh_flush_is_the_sort_sensors_and_the_lifecycle_step_sorts_only_leftovers(
    system: System, instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, producer: Producer
) -> None:
    """A lifecycle run that lands right after a flush neither sorts nor merges the new segments:
    they are the sort sensor's, so their sort shows as `sorted_segments` with its check (it did
    not: a deployment whose lifecycle step came first never evaluated `sorted_rows_conserved`);
    segments still unsorted VCHAN_SORT_LEFTOVER_AFTER seconds after their flush are the step's."""
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    instance.add_dynamic_partitions("vchannels", list(info.vchannels))
    produced = flushed_batches(system, producer, info, batches=2)
    assert dg.materialize([segment_lifecycle], instance=instance, resources={"vchan": vchan}).success
    fresh = live_l1(store, info)
    assert len(fresh) == 2 and not any(s.is_sorted for s in fresh)
    [request] = evaluate(sort_sensor, instance, vchan).run_requests or []
    assert _sorts(request, info) == list(info.vchannels)

    later = time.time() + system.settings.sort_leftover_after + 1
    report = lifecycle_step(system, now=later, sort_grace=system.settings.sort_leftover_after, collect=False)
    assert [o.state for o in report.outcomes] == [PlanState.COMPLETED]
    [leftover] = live_l1(store, info)  # merged by mix compaction, which sorts
    assert leftover.is_sorted and sorted(leftover.compaction_from) == sorted(s.id for s in fresh)
    assert_lifecycle_invariants(system, info, produced)


def _sorts(request: dg.RunRequest, info: CollectionInfo) -> list[str]:
    """The vchannels of `info` a sort run request names."""
    asked = request.run_config["ops"]["sort_segments"]["config"]["vchannels"]
    return [v for v in asked if v in info.vchannels]


def test_a_sort_run_failed_before_it_started_is_asked_for_again_up_to_twice(
    system: System, instance: dg.DagsterInstance, vchan: VchanResource, producer: Producer
) -> None:
    """A sort run that run monitoring failed because its process had not started within its
    start timeout (a loaded machine) changed no task: what waits is the same, and it is
    asked for again (it was not: the run key of the same state was never repeated, and the
    flushed segments waited for the lifecycle's leftover sort); after two such retries, no
    more until what waits changes."""
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    instance.add_dynamic_partitions("vchannels", list(info.vchannels))
    flushed_batches(system, producer, info, batches=1)
    keys = []
    for _ in range(3):
        [request] = evaluate(sort_sensor, instance, vchan).run_requests or []
        assert _sorts(request, info) == list(info.vchannels)
        keys.append(request.run_key)
        run = instance.create_run_for_job(
            sort_job, run_config=request.run_config, tags={"dagster/run_key": request.run_key}
        )
        instance.report_run_failed(run, "the run's process did not start within 60 s")
    assert len(set(keys[:2])) == 2 and keys[2] in keys[1:]  # asked again once, twice, then no new key


def test_sort_sensor_requests_one_sort_run_for_every_vchannel_with_newly_flushed_segments(
    system: System, instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, producer: Producer
) -> None:
    """One run sorts every vchannel that waits and reports each as its partition of
    `sorted_segments` with its check; none is asked for while one is queued; the next one
    names only the vchannels still waiting."""
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=2)
    instance.add_dynamic_partitions("vchannels", list(info.vchannels))
    produced = flushed_batches(system, producer, info, batches=1)
    flushed = {s.id: s.vchannel for s in live_l1(store, info)}
    [request] = evaluate(sort_sensor, instance, vchan).run_requests or []
    assert _sorts(request, info) == sorted(info.vchannels)

    queued = instance.create_run_for_job(sort_job, run_config=request.run_config)
    waiting = evaluate(sort_sensor, instance, vchan)
    assert not waiting.run_requests and "a sort run is queued or running" in skip_message(waiting)
    instance.report_run_canceled(queued)

    first, second = info.vchannels
    result = sort_job.execute_in_process(
        run_config=dg.RunConfig(ops={"sort_segments": VchannelsConfig(vchannels=[first, "dropped-v0"])}),
        instance=instance,
        resources={"vchan": vchan},
    )
    assert result.success
    [materialization] = [
        e.event_specific_data.materialization  # type: ignore[union-attr]
        for e in result.all_events
        if e.event_type is dg.DagsterEventType.ASSET_MATERIALIZATION
    ]
    assert (materialization.asset_key, materialization.partition) == (SORTED_SEGMENTS, first)
    assert materialization.metadata["sorted"].value == 1
    assert materialization.metadata["flush_to_sorted_s_max"].value > 0
    [check] = result.get_asset_check_evaluations()
    assert check.passed and check.partition == first, check.description
    # only that vchannel's segment was sorted; the sensor now asks for the other one only
    now = {s.vchannel: s for s in live_l1(store, info)}
    assert now[first].is_sorted and now[first].compaction_from == tuple(
        i for i, v in flushed.items() if v == first
    )
    assert not now[second].is_sorted
    [again] = evaluate(sort_sensor, instance, vchan).run_requests or []
    assert _sorts(again, info) == [second] and again.run_key != request.run_key

    # The asset itself still sorts one partition (materialized from the UI).
    manual = dg.materialize(
        [sorted_segments], instance=instance, resources={"vchan": vchan}, partition_key=second
    )
    assert manual.success
    [materialization] = manual.asset_materializations_for_node("sorted_segments")
    assert materialization.metadata["sorted"].value == 1
    assert all(c.passed for c in manual.get_asset_check_evaluations())
    assert all(s.is_sorted for s in live_l1(store, info))
    assert_lifecycle_invariants(system, info, produced)


def test_lifecycle_sensors_stand_by_while_a_datacoord_process_leads_the_election(
    system: System,
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    producer: Producer,
) -> None:
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    instance.add_dynamic_partitions("vchannels", list(info.vchannels))
    flushed_batches(system, producer, info, batches=1)  # a segment waits for its sort
    process = DataCoordinator(dsettings, system.store)  # what `vchan datacoord` runs: it sorts and compacts
    assert process.election.campaign(timeout=10)
    try:
        for sensor in (sort_sensor, lifecycle_sensor, index_sensor):
            idle = evaluate(sensor, instance, vchan)
            assert not idle.run_requests and "runs the lifecycle" in skip_message(idle)
    finally:
        process.election.resign()
    # Nobody leads (or Dagster's DataCoord does): Dagster runs the lifecycle.
    [sort] = evaluate(sort_sensor, instance, vchan).run_requests or []
    assert _sorts(sort, info) == list(info.vchannels)
    assert evaluate(lifecycle_sensor, instance, vchan).run_requests


def _sort_task(store: MetaStore, segment_id: int) -> TaskRecord | None:
    found = [d.model for d in list_tasks(store, "sort") if d.model.segment_id == segment_id]
    return found[0] if found else None


def _backoff_passes(store: MetaStore, segment_id: int) -> None:
    """The task's wait (its backoff) is over: its `not_before` moved to the past."""
    [d] = [d for d in list_tasks(store, "sort") if d.model.segment_id == segment_id]
    store.cas(d.kv.key, d.kv.version, replace(d.model, not_before=time.time() - 1.0))


def test_a_sort_that_fails_every_time_ends_failed_through_the_asset_and_is_not_asked_for_until_its_next_try(
    system: System,
    instance: dg.DagsterInstance,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`sorted_segments` sorts through the DataCoord's sort tasks: a segment whose sort
    fails (a binlog gone) spends an attempt per run, backs off (the sensor asks no run for
    it, a run meanwhile does not try it), and is Failed after VCHAN_TASK_MAX_ATTEMPTS (3),
    named with its next try in the metadata; it is tried again only after `vchan tasks
    --retry` (before, every run of its vchannel sorted it again)."""
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    [vchannel] = info.vchannels
    instance.add_dynamic_partitions("vchannels", [vchannel])
    produced = flushed_batches(system, producer, info, batches=1)
    [poison] = live_l1(store, info)
    path = poison.binlog_files[0].path
    saved = system.storage.read_bytes(path)
    system.storage.delete(path)
    vchan = VchanResource.from_settings(replace(dsettings, task_retry_backoff=600.0))

    def materialize() -> dict[str, Any]:
        result = dg.materialize(
            [sorted_segments], instance=instance, resources={"vchan": vchan}, partition_key=vchannel
        )
        assert result.success
        [materialization] = result.asset_materializations_for_node("sorted_segments")
        return {k: v.value for k, v in materialization.metadata.items()}

    first = materialize()
    assert (first["sorted"], first["failed"], first["task_attempts_failed"]) == (0, 1, 1)
    assert first["tasks_backing_off"] == 1 and first["tasks_failed"] == 0
    assert f"segment {poison.id}: backing off after 1 attempts, next try 20" in first["held_segments"]
    idle = evaluate(sort_sensor, instance, vchan)
    assert not idle.run_requests and "next try" in skip_message(idle), "no run while it backs off"
    assert materialize()["task_attempts"] == 0, "a run meanwhile does not try it"

    for _ in range(2):
        _backoff_passes(store, poison.id)
        assert evaluate(sort_sensor, instance, vchan).run_requests, "asked for again once its backoff passed"
        last = materialize()
    assert last["task_attempts"] == 1 and last["tasks_failed"] == 1
    assert f"segment {poison.id}: Failed after 3 attempts, next try 20" in last["held_segments"]
    assert last["next_retry"].startswith("20")
    task = _sort_task(store, poison.id)
    assert task is not None and task.state is TaskState.FAILED and task.attempts == 3 and task.failures == 1

    assert not evaluate(sort_sensor, instance, vchan).run_requests, "a Failed task waits for its next try"
    assert materialize()["task_attempts"] == 0
    assert _sort_task(store, poison.id) == task
    later = time.time() + system.settings.sort_leftover_after + 1
    step = lifecycle_step(system, now=later, sort_grace=system.settings.sort_leftover_after, collect=False)
    planned = [store.get_model(store.keys.compaction_plan(i), CompactionPlan) for i in step.planned]
    assert not [
        d.model
        for d in planned
        if d and d.model.type is not CompactionType.L0 and poison.id in d.model.input_ids
    ], "nor does the lifecycle step's leftover sort take it"

    system.storage.write_atomic(path, saved)
    retry = argparse.Namespace(retry=True, kind="sort", collection=info.name)
    assert vchan_tasks(retry, dsettings) == 0
    assert "re-queued 1 failed sort tasks" in capsys.readouterr().out
    assert evaluate(sort_sensor, instance, vchan).run_requests, "asked for again after `vchan tasks --retry`"
    done = materialize()
    assert (done["sorted"], done["task_attempts"], done["tasks_failed"]) == (1, 1, 0)
    assert _sort_task(store, poison.id) is None, "a done task is deleted"
    assert all(s.is_sorted for s in live_l1(store, info))
    assert_lifecycle_invariants(system, info, produced)
