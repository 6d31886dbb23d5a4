"""The hand-off in the Dagster lineage: `visible_segments` (the query view of a vchannel)
materialized after `sorted_segments` with its two checks, each check failing when its
invariant is broken, and the sensor that requests it when a vchannel's segment meta
changes. Dagster's `materialize` on an ephemeral instance, the sort on Spark Connect, real
etcd and files."""

from __future__ import annotations

import uuid
from dataclasses import replace

import dagster as dg
import pytest
import yaml

from vchan_assets.config import Settings
from vchan_assets.defs.lifecycle.assets import sorted_segments
from vchan_assets.defs.partitions import VchannelsConfig
from vchan_assets.defs.query.assets import query_view_job, query_view_sensor, visible_segments
from vchan_assets.defs.resources import VchanResource
from vchan_assets.deploy.service import INSTANCE_CONFIG
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Produced, produce
from vchan_assets.testing.steps import flushed_batches, live_l1, sync_all, write_twice
from vchan_assets.wal.producer import Producer

from .helpers import evaluate


@pytest.fixture
def flushed_once(system: System, instance: dg.DagsterInstance, producer: Producer) -> CollectionInfo:
    """A collection of one vchannel (a partition of the instance) with one flushed round:
    200 rows, 10 of them deleted, in one invisible segment."""
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    instance.add_dynamic_partitions("vchannels", list(info.vchannels))
    flushed_batches(system, producer, info, batches=1)
    return info


def view_of(
    instance: dg.DagsterInstance, vchan: VchanResource, vchannel: str
) -> tuple[dict[str, object], dict[str, dg.AssetCheckEvaluation]]:
    """Materialize `visible_segments` of one vchannel: its metadata values and its checks by name."""
    result = dg.materialize(
        [visible_segments], instance=instance, resources={"vchan": vchan}, partition_key=vchannel
    )
    assert result.success
    [materialization] = result.asset_materializations_for_node("visible_segments")
    metadata = {k: v.value for k, v in materialization.metadata.items()}
    return metadata, {c.check_name: c for c in result.get_asset_check_evaluations()}


def test_visible_segments_after_the_sort_in_one_run_serve_every_row_once_with_passing_checks(
    instance: dg.DagsterInstance, vchan: VchanResource, flushed_once: CollectionInfo
) -> None:
    [vchannel] = flushed_once.vchannels
    before, _ = view_of(instance, vchan, vchannel)
    assert (before["flushed"], before["invisible"]) == (0, 1)

    result = dg.materialize(  # flushed -> sorted -> visible, in lineage order
        [sorted_segments, visible_segments],
        instance=instance,
        resources={"vchan": vchan},
        partition_key=vchannel,
    )
    assert result.success
    [view] = result.asset_materializations_for_node("visible_segments")
    assert view.metadata["flushed"].value == 1 and view.metadata["invisible"].value == 0
    assert view.metadata["rows_served"].value == 190  # 200 rows, 10 deleted
    assert view.metadata["sorts_in_meta"].value == 1 and view.metadata["flush_to_sorted_s_max"].value > 0
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert set(checks) == {"sorted_rows_conserved", "rows_served_once", "invisible_segments_bounded"}
    assert all(c.passed for c in checks.values()), [c.description for c in checks.values()]


def test_the_invisible_check_fails_when_the_sort_falls_behind_the_limit(
    system: System,
    instance: dg.DagsterInstance,
    dsettings: Settings,
    producer: Producer,
    flushed_once: CollectionInfo,
) -> None:
    info = flushed_once
    flushed_batches(system, producer, info, batches=1, first_batch=1)  # no sort
    strict = VchanResource.from_settings(replace(dsettings, invisible_segment_limit=1))
    metadata, checks = view_of(instance, strict, info.vchannels[0])
    assert metadata["invisible"] == 2 and metadata["oldest_invisible_s"] > 0
    assert not checks["invisible_segments_bounded"].passed
    assert "2 flushed segments wait for their sort" in str(checks["invisible_segments_bounded"].description)
    assert checks["rows_served_once"].passed  # served as growing, each row once

    at_limit = VchanResource.from_settings(replace(dsettings, invisible_segment_limit=2))
    _, checks = view_of(instance, at_limit, info.vchannels[0])
    assert checks["invisible_segments_bounded"].passed


def test_the_rows_check_fails_when_a_segment_meta_is_written_twice(
    instance: dg.DagsterInstance, vchan: VchanResource, store: MetaStore, flushed_once: CollectionInfo
) -> None:
    [seg] = live_l1(store, flushed_once)
    write_twice(store, seg)

    metadata, checks = view_of(instance, vchan, flushed_once.vchannels[0])
    served = checks["rows_served_once"]
    assert not served.passed and served.metadata["rows_served_twice"].value == 190
    assert metadata["rows_served"] == 380 and metadata["invisible"] == 2
    assert checks["invisible_segments_bounded"].passed


def _views(request: dg.RunRequest) -> list[str]:
    return request.run_config["ops"]["query_views"]["config"]["vchannels"]


def test_the_sensor_requests_one_view_run_for_the_vchannels_whose_segment_meta_changed(
    system: System, instance: dg.DagsterInstance, vchan: VchanResource, producer: Producer
) -> None:
    """One run for every vchannel that changed since the sensor last asked (its cursor), none
    while a view run is queued or running: view runs grow with time, not with the syncs."""
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=2)
    assert not evaluate(query_view_sensor, instance, vchan).run_requests  # no partition, no segment
    instance.add_dynamic_partitions("vchannels", list(info.vchannels))
    produce(producer, info.name, Produced(), 100, start_pk=0)  # pks 0..99: both vchannels
    sync_all(system, info)

    first = evaluate(query_view_sensor, instance, vchan)
    [request] = first.run_requests or []
    assert _views(request) == sorted(info.vchannels)
    # one view run at a time in the instance, dequeued after the syncs (dagster.yaml)
    assert request.tags == {"vchan/view": "query_view", "dagster/priority": "-1"}
    limits = yaml.safe_load(INSTANCE_CONFIG.read_text())["run_coordinator"]["config"][
        "tag_concurrency_limits"
    ]
    assert {"key": "vchan/view", "limit": 1} in limits
    again = evaluate(query_view_sensor, instance, vchan, cursor=first.cursor)
    assert not again.run_requests  # nothing changed since

    produce(producer, info.name, Produced(), 1, start_pk=1_000)  # pk 1000: one vchannel only
    sync_all(system, info)
    queued = instance.create_run_for_job(query_view_job, run_config=request.run_config, tags=request.tags)
    assert not evaluate(query_view_sensor, instance, vchan, cursor=again.cursor).run_requests
    instance.report_run_canceled(queued)
    [changed] = evaluate(query_view_sensor, instance, vchan, cursor=again.cursor).run_requests or []
    assert _views(changed) == [info.vchannels[1000 % 2]]
    assert changed.run_key != request.run_key


def test_the_vchannels_of_a_failed_view_run_are_asked_for_again_up_to_twice(
    system: System, instance: dg.DagsterInstance, vchan: VchanResource, producer: Producer
) -> None:
    """A view run that failed without a change of its vchannels (run monitoring failed it:
    its process had not started in time) is asked for again (it was not: the cursor had
    moved past them, so a quiet vchannel's view stayed unmaterialized until it changed);
    after two retries of the same state, no more."""
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    instance.add_dynamic_partitions("vchannels", list(info.vchannels))
    produce(producer, info.name, Produced(), 10, start_pk=0)
    sync_all(system, info)
    cursor, keys = None, []
    for _ in range(3):
        result = evaluate(query_view_sensor, instance, vchan, cursor=cursor)
        [request] = result.run_requests or []
        assert _views(request) == list(info.vchannels)
        keys.append(request.run_key)
        cursor = result.cursor
        run = instance.create_run_for_job(
            query_view_job,
            run_config=request.run_config,
            tags={**request.tags, "dagster/run_key": request.run_key},
        )
        instance.report_run_failed(run, "the run's process did not start within 60 s")
    assert len(set(keys[:2])) == 2 and keys[2] in keys[1:]  # asked again once, twice, then no new key


def test_a_view_run_reports_the_view_of_each_vchannel_as_its_partition_with_its_checks(
    instance: dg.DagsterInstance, vchan: VchanResource, flushed_once: CollectionInfo
) -> None:
    [vchannel] = flushed_once.vchannels
    result = query_view_job.execute_in_process(
        run_config=dg.RunConfig(ops={"query_views": VchannelsConfig(vchannels=[vchannel, "dropped-v0"])}),
        instance=instance,
        resources={"vchan": vchan},
    )
    assert result.success
    [view] = [
        e.event_specific_data.materialization  # type: ignore[union-attr]
        for e in result.all_events
        if e.event_type is dg.DagsterEventType.ASSET_MATERIALIZATION
    ]
    assert (view.asset_key, view.partition) == (dg.AssetKey("visible_segments"), vchannel)
    assert view.metadata["invisible"].value == 1 and view.metadata["rows_served"].value == 190
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert set(checks) == {"rows_served_once", "invisible_segments_bounded"}
    assert all(c.passed and c.partition == vchannel for c in checks.values())
    latest = instance.get_latest_materialization_event(dg.AssetKey("visible_segments"))
    assert latest is not None and latest.run_id == result.run_id


def test_a_vchannel_whose_view_cannot_be_read_fails_the_run_after_the_others_are_reported(
    system: System,
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    producer: Producer,
    flushed_once: CollectionInfo,
) -> None:
    """One run reports many vchannels: a malformed channel checkpoint in one of them must not
    hide the views of the others; the run fails at the end, naming it."""
    broken = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    flushed_batches(system, producer, broken, batches=1)
    [bad], [good] = broken.vchannels, flushed_once.vchannels
    system.store.put(system.store.keys.channel_checkpoint(bad), b"{not json")

    result = query_view_job.execute_in_process(
        run_config=dg.RunConfig(ops={"query_views": VchannelsConfig(vchannels=[bad, good])}),
        instance=instance,
        resources={"vchan": vchan},
        raise_on_error=False,
    )
    assert not result.success
    reported = [
        e.event_specific_data.materialization.partition  # type: ignore[union-attr]
        for e in result.all_events
        if e.event_type is dg.DagsterEventType.ASSET_MATERIALIZATION
    ]
    assert reported == [good]
    failure = result.failure_data_for_node("query_views")
    assert failure is not None and "the view of 1 of 2 vchannels failed" in str(failure.error)
    assert failure.user_failure_data is not None and bad in failure.user_failure_data.metadata
    assert "MalformedValueError" in str(failure.user_failure_data.metadata[bad].value)
