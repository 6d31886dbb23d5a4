"""The sync loop of a Dagster-hosted node (defs/sync/loop.py) and run retention
(defs/retention.py): the loop job run in process on an ephemeral instance, through Spark
Connect, against a real etcd and real files; the node and sync sensors evaluated with
Dagster's own context builder."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import dagster as dg
import pytest
from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.defs.cluster.datanodes import NodeCursor
from vchan_assets.defs.resources import VchanResource, pyspark_resource
from vchan_assets.defs.retention import prune_runs
from vchan_assets.defs.sync.assets import BINLOGS, CHANNEL_CHECKPOINTS, SEGMENTS
from vchan_assets.defs.sync.jobs import LOOP_JOB, LOOP_TAG
from vchan_assets.defs.sync.loop import AtTeardown, NodeSyncLoop, loop_runs, node_sync_loop_job
from vchan_assets.defs.sync.sensor import dagster_nodes, sync_sensor
from vchan_assets.demo.via_dagster import latest_checks
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.testing.dagster_jobs import one_op
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import NODE1, NODE2, SCHEMA, evaluate, watched_by_a_dagster_node


@pytest.fixture
def vchan(dsettings: Settings) -> VchanResource:
    """Sessions that outlive a loaded machine's slowest step (a first Spark job can take a
    minute): the loop ends when its node's session is gone, and these tests end it on
    purpose only."""
    return VchanResource.from_settings(replace(dsettings, session_ttl=300.0))


@pytest.fixture
def node(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, collection: CollectionInfo
) -> NodeCursor:
    """A Dagster-hosted node (sensor slot 1) that watches every channel of `collection`."""
    return watched_by_a_dagster_node(instance, vchan, store)[0]


def run_loop(
    instance: dg.DagsterInstance, vchan: VchanResource, node_id: int, session_lease: int, seconds: float = 0.0
) -> dg.ExecuteInProcessResult:
    """One loop run; `seconds=0`: one look at the channels, then it ends."""
    evaluate(NODE1, instance, vchan, NodeCursor(node_id, session_lease).dump())  # keeps the session alive
    return node_sync_loop_job.execute_in_process(
        run_config={"ops": {"node_sync_loop": {"config": {"node_id": node_id, "seconds": seconds}}}},
        instance=instance,
        resources={"vchan": vchan, "pyspark": pyspark_resource(vchan.settings()), "teardown": AtTeardown()},
    )


def history(instance: dg.DagsterInstance, vchannel: str) -> list[dg.AssetMaterialization]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=CHANNEL_CHECKPOINTS.key, asset_partitions=[vchannel]), limit=100
    ).records
    return [r.asset_materialization for r in records if r.asset_materialization is not None]


def test_the_loop_reports_every_sync_as_materializations_and_checks_of_its_run(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    node: NodeCursor,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    producer.insert(collection.name, generate_rows(SCHEMA, 1_000, start_pk=1, seed=1))
    time.sleep(1.1)  # VCHAN_SYNC_MAX_AGE=1 in these tests

    first = run_loop(instance, vchan, node.node_id, node.session_lease)
    assert first.success
    events = first.asset_materializations_for_node("node_sync_loop")
    assert {(m.asset_key, m.partition) for m in events} == {
        (key, v) for key in (BINLOGS.key, SEGMENTS.key, CHANNEL_CHECKPOINTS.key) for v in collection.vchannels
    }
    binlogs = [m for m in events if m.asset_key == BINLOGS.key]
    assert sum(int(str(m.metadata["rows"].value)) for m in binlogs) == 1_000
    assert all(m.metadata["node_id"].value == node.node_id for m in events)
    checks = first.get_asset_check_evaluations()
    assert len(checks) == 8 and all(c.passed for c in checks), [(c.check_name, c.description) for c in checks]
    # What `vchan demo` reports: the latest check results of each channel, from the loop run.
    latest = latest_checks(instance, list(collection.vchannels))
    assert len(latest) == 8 and all(latest.values()), latest
    for vchannel in collection.vchannels:
        (reported,) = history(instance, vchannel)
        cp = channel_checkpoint(store, vchannel)
        assert cp is not None and reported.metadata["checkpoint_offset"].value == cp.model.offset

    # The next loop run goes on from there: one more entry per synced channel in the
    # assets' history, its previous checkpoint the one the first loop reported.
    producer.insert(collection.name, generate_rows(SCHEMA, 500, start_pk=5_000, seed=2))
    time.sleep(1.1)
    assert run_loop(instance, vchan, node.node_id, node.session_lease).success
    for vchannel in collection.vchannels:
        latest, earlier = history(instance, vchannel)
        assert (
            latest.metadata["previous_checkpoint_offset"].value == earlier.metadata["checkpoint_offset"].value
        )
        assert latest.metadata["checkpoint_offset"].value > earlier.metadata["checkpoint_offset"].value  # type: ignore[operator]


def test_a_look_with_nothing_to_sync_asks_dagster_for_no_runs(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    node: NodeCursor,
    producer: Producer,
    collection: CollectionInfo,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node's loop looks at its channels twice a second and the sync sensor ticks every
    second. They asked Dagster for its sync runs in flight at each look (a run storage
    query, most of an idle loop's CPU); now only when a sync policy fired."""
    time.sleep(1.1)  # the collection's DDL message waits for a sync (VCHAN_SYNC_MAX_AGE=1)
    assert run_loop(instance, vchan, node.node_id, node.session_lease).success
    asked: list[dg.RunsFilter | None] = []
    records = instance.get_run_records

    def counted(filters: dg.RunsFilter | None = None, *args: Any, **kwargs: Any) -> Any:
        asked.append(filters)
        return records(filters, *args, **kwargs)

    monkeypatch.setattr(instance, "get_run_records", counted)
    with vchan.open() as runtime:
        loop = NodeSyncLoop(runtime, instance, node.node_id, node.session_lease)
        try:
            assert loop.step() == 0
            assert not evaluate(sync_sensor, instance, vchan).run_requests
            assert asked == []
            producer.insert(collection.name, generate_rows(SCHEMA, 100, start_pk=1, seed=3))
            time.sleep(1.1)
            assert loop.step() == len(collection.vchannels)
            assert asked  # a channel to sync: in flight in a sync run?
        finally:
            loop.close()


def test_the_loop_of_a_node_whose_session_is_gone_ends_and_syncs_nothing(
    instance: dg.DagsterInstance, vchan: VchanResource, node: NodeCursor, store: MetaStore
) -> None:
    time.sleep(1.1)  # the collection's DDL message waits for a sync (VCHAN_SYNC_MAX_AGE=1)
    store.revoke(node.session_lease)  # the node's sensor stopped for longer than its TTL
    result = run_loop(instance, vchan, node.node_id, node.session_lease, seconds=600)
    assert result.success
    assert not result.asset_materializations_for_node("node_sync_loop")


def test_the_node_sensor_keeps_one_loop_run_per_node_and_the_sync_sensor_leaves_its_channels_alone(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    node: NodeCursor,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    tick = evaluate(NODE1, instance, vchan, node.dump())
    (loop,) = [r for r in tick.run_requests or [] if r.job_name == LOOP_JOB]
    assert loop.run_key == f"loop:{node.node_id}:0" and loop.tags[LOOP_TAG] == str(node.node_id)
    assert loop.run_config["ops"]["node_sync_loop"]["config"]["seconds"] == vchan.settings().dagster_sync_loop

    # The loop is in flight, not started yet: no second one; the sync sensor still serves
    # the node's channels (a loop that does not run yet syncs nothing).
    queued = instance.create_run_for_job(node_sync_loop_job, run_config=loop.run_config, tags=loop.tags)
    assert loop_runs(instance, node.node_id, [dg.DagsterRunStatus.NOT_STARTED]) == 1
    again = evaluate(NODE1, instance, vchan, node.dump())
    assert not [r for r in again.run_requests or [] if r.job_name == LOOP_JOB]
    producer.insert(collection.name, generate_rows(SCHEMA, 300, start_pk=1, seed=1))
    time.sleep(1.1)
    assert evaluate(sync_sensor, instance, vchan).run_requests

    # Once it runs, the channels are the loop's: no sync runs for them.
    instance.report_run_failed(queued)
    running = instance.create_run_for_job(
        node_sync_loop_job, run_config=loop.run_config, tags=loop.tags, status=dg.DagsterRunStatus.STARTED
    )
    assert not evaluate(sync_sensor, instance, vchan).run_requests

    # It ended: the node sensor asks for the next one, and the sync sensor serves the
    # channels with runs meanwhile.
    instance.report_run_failed(running)
    nxt = evaluate(NODE1, instance, vchan, node.dump())
    assert [r.run_key for r in nxt.run_requests or [] if r.job_name == LOOP_JOB] == [f"loop:{node.node_id}:2"]
    assert sorted(
        r.partition_key or "" for r in evaluate(sync_sensor, instance, vchan).run_requests or []
    ) == sorted(collection.vchannels)


def test_the_loop_keeps_its_node_alive_between_slow_sensor_ticks_unless_the_sensor_was_stopped(
    instance: dg.DagsterInstance, dsettings: Settings
) -> None:
    """A node's session (TTL 2 s here) outlives ticks of its sensor that come later than the
    TTL (a loaded daemon) while its loop polls; once the node's sensor is stopped the loop no
    longer keeps it, the session expires and the loop sees its node gone."""
    short = VchanResource.from_settings(dsettings)  # session TTL 2 s
    kept, dropped = (NodeCursor.parse(evaluate(slot, instance, short).cursor) for slot in (NODE1, NODE2))
    assert dsettings.session_ttl == 2.0
    with short.open() as runtime:
        loops = [
            NodeSyncLoop(runtime, instance, kept.node_id, kept.session_lease),
            NodeSyncLoop(
                runtime, instance, dropped.node_id, dropped.session_lease, keep_session=lambda: False
            ),
        ]
        alive: list[tuple[bool, bool]] = []
        ends = time.monotonic() + 3 * dsettings.session_ttl + 1
        while time.monotonic() < ends:  # no sensor tick meanwhile
            alive.append((loops[0].alive(), loops[1].alive()))
            time.sleep(0.25)
        for loop in loops:
            loop.close()
        assert all(a for a, _ in alive)
        assert alive[-1][1] is False and dropped.node_id not in dagster_nodes(runtime)
        assert kept.node_id in dagster_nodes(runtime)


def test_a_node_that_lost_its_session_cancels_the_queued_loop_of_its_earlier_node(
    instance: dg.DagsterInstance, dsettings: Settings, store: MetaStore
) -> None:
    """Started, a loop of a node that is gone would only find it gone and end, after the
    seconds a run process takes to start on a loaded machine: the slot's new node cancels it
    in the queue and asks for its own."""
    short = VchanResource.from_settings(dsettings)
    first = evaluate(NODE1, instance, short)
    old = NodeCursor.parse(first.cursor)
    (request,) = [r for r in first.run_requests or [] if r.job_name == LOOP_JOB]
    assert request.run_config["ops"]["node_sync_loop"]["config"]["session_lease"] == old.session_lease
    tags = {**request.tags, "dagster/sensor_name": NODE1.name}
    location = InProcessCodeLocationOrigin(LoadableTargetOrigin(module_name="vchan_assets.defs.definitions"))
    queued = instance.create_run_for_job(  # in the daemon's run queue
        node_sync_loop_job,
        run_config=request.run_config,
        tags=tags,
        status=dg.DagsterRunStatus.QUEUED,
        remote_job_origin=RemoteJobOrigin(RemoteRepositoryOrigin(location, "__repository__"), LOOP_JOB),
    )
    store.revoke(old.session_lease)  # its sensor did not tick within the TTL

    later = evaluate(NODE1, instance, short, old.dump())

    new = NodeCursor.parse(later.cursor)
    assert new.node_id != old.node_id
    cancelled = instance.get_run_by_id(queued.run_id)
    assert cancelled is not None and cancelled.status == dg.DagsterRunStatus.CANCELED
    assert [r.run_key for r in later.run_requests or [] if r.job_name == LOOP_JOB] == [
        f"loop:{new.node_id}:0"
    ]


def test_without_a_loop_the_node_sensor_requests_none(
    instance: dg.DagsterInstance, dsettings: Settings, store: MetaStore
) -> None:
    runs = VchanResource.from_settings(replace(dsettings, dagster_sync_loop=0.0))
    node, _ = watched_by_a_dagster_node(instance, runs, store)
    tick = evaluate(NODE1, instance, runs, node.dump())
    assert not [r for r in tick.run_requests or [] if r.job_name == LOOP_JOB]


@dg.asset
def reported() -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"n": 1})


def test_retention_deletes_finished_runs_and_their_history_and_keeps_runs_in_flight(
    instance: dg.DagsterInstance,
) -> None:
    done = dg.materialize([reported], instance=instance)
    assert instance.fetch_materializations(reported.key, limit=10).records
    in_flight = instance.create_run_for_job(one_op)  # NOT_STARTED

    assert prune_runs(instance, before=time.time() - 3600) == []  # nothing that old
    assert prune_runs(instance, before=time.time() + 1) == [done.run_id]
    assert instance.get_run_by_id(done.run_id) is None
    assert not instance.fetch_materializations(reported.key, limit=10).records
    assert instance.get_run_by_id(in_flight.run_id) is not None
