"""The sync multi-asset and the segment catalog, materialized with Dagster's `materialize`
on an ephemeral instance, through Spark Connect, against a real etcd and real files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import channel_checkpoint, channel_segments
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.defs.resources import VchanResource, pyspark_resource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.defs.sync.assets import (
    BINLOGS,
    CHANNEL_CHECKPOINTS,
    SEGMENTS,
    segment_table,
    sync_vchannel,
)
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, CollectionInfo, WatchState
from vchan_assets.system import System
from vchan_assets.testing.harness import cli_env
from vchan_assets.testing.waiting import wait_stopped
from vchan_assets.wal.producer import Producer, generate_rows

from .helpers import SCHEMA, watched_by_a_dagster_node


def materialize_sync(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    settings: Settings,
    vchannel: str,
    config: dict[str, object],
    raise_on_error: bool = True,
    selection: dg.AssetSelection | None = None,
) -> dg.ExecuteInProcessResult:
    instance.add_dynamic_partitions("vchannels", [vchannel])
    return dg.materialize(
        [sync_vchannel],
        selection=selection,
        partition_key=vchannel,
        instance=instance,
        resources={"vchan": vchan, "pyspark": pyspark_resource(settings)},
        run_config={"ops": {"sync_vchannel": {"config": config}}},
        raise_on_error=raise_on_error,
    )


def test_sync_materializes_binlogs_segments_checkpoints_with_metadata_and_passing_checks(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 1_000, start_pk=1, seed=1))
    producer.delete(collection.name, list(range(1, 101)))
    vchannel = collection.vchannels[0]
    config = {"lease_id": infos[vchannel].lease_id, "node_id": node.node_id, "reason": "test"}

    result = materialize_sync(instance, vchan, dsettings, vchannel, config)
    assert result.success
    by_asset = {m.asset_key: m for m in result.asset_materializations_for_node("sync_vchannel")}
    assert set(by_asset) == {BINLOGS.key, SEGMENTS.key, CHANNEL_CHECKPOINTS.key}
    assert all(m.partition == vchannel for m in by_asset.values())
    binlogs = by_asset[BINLOGS.key].metadata
    assert binlogs["rows"].value > 0 and binlogs["files"].value > 0 and binlogs["bytes"].value > 0
    assert binlogs["deletes"].value > 0
    assert binlogs["written_by"].value == "Spark job"  # the test settings pin Spark
    phases = [binlogs[f"seconds_{p}"].value for p in ("state", "binlogs", "commit")]
    assert min(phases) >= 0 and sum(phases) == pytest.approx(binlogs["seconds"].value, abs=0.005)
    cp = by_asset[CHANNEL_CHECKPOINTS.key].metadata
    assert cp["checkpoint_offset"].value == store_checkpoint(store, vchannel)
    assert cp["checkpoint_lag_messages"].value == 0
    assert str(cp["position_range"].value).startswith("(")
    checks = result.get_asset_check_evaluations()
    assert len(checks) == 4 and all(c.passed for c in checks), [(c.check_name, c.description) for c in checks]

    # A second sync with more data: the checkpoint moves forward, the monotonic check
    # compares against the previous materialization.
    producer.insert(collection.name, generate_rows(SCHEMA, 500, start_pk=5_000, seed=2))
    second = materialize_sync(instance, vchan, dsettings, vchannel, config)
    assert second.success
    cp2 = {m.asset_key: m for m in second.asset_materializations_for_node("sync_vchannel")}[
        CHANNEL_CHECKPOINTS.key
    ]
    assert cp2.metadata["previous_checkpoint_offset"].value == cp["checkpoint_offset"].value
    assert cp2.metadata["checkpoint_offset"].value > cp["checkpoint_offset"].value
    assert all(c.passed for c in second.get_asset_check_evaluations())


def store_checkpoint(store: MetaStore, vchannel: str) -> int:
    from vchan_assets.datacoord.recovery import channel_checkpoint

    cp = channel_checkpoint(store, vchannel)
    assert cp is not None
    return cp.model.offset


def test_sync_with_a_lease_that_moved_commits_nothing_and_fails_the_run(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 100, start_pk=1, seed=1))
    vchannel = collection.vchannels[0]
    stale = {"lease_id": infos[vchannel].lease_id + 1_000_000, "node_id": node.node_id}
    instance.add_dynamic_partitions("vchannels", [vchannel])
    result = dg.materialize(
        [sync_vchannel],
        partition_key=vchannel,
        instance=instance,
        resources={"vchan": vchan, "pyspark": pyspark_resource(dsettings)},
        run_config={"ops": {"sync_vchannel": {"config": stale}}},
        raise_on_error=False,
    )
    assert not result.success
    assert "lease lost" in str(result.failure_data_for_node("sync_vchannel").error)  # type: ignore[union-attr]
    assert channel_checkpoint(store, vchannel) is None


def test_release_run_syncs_then_answers_release_success(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 200, start_pk=1, seed=1))
    vchannel = collection.vchannels[1]
    key = store.keys.channel_watch(node.node_id, vchannel)
    kv = store.get(key)
    assert kv is not None
    store.cas(key, kv.version, replace(infos[vchannel], state=WatchState.TO_RELEASE))
    config = {
        "lease_id": infos[vchannel].lease_id,
        "node_id": node.node_id,
        "release": True,
        "watch_key": key,
    }
    result = materialize_sync(instance, vchan, dsettings, vchannel, config)
    assert result.success
    released = store.get_model(key, ChannelWatchInfo)
    assert released is not None and released.model.state is WatchState.RELEASE_SUCCESS
    assert store_checkpoint(store, vchannel) > 0


def test_a_release_run_whose_lease_moved_on_answers_release_success_and_materializes_nothing(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    """The channel was given to another writer before the release run started: no final
    sync, the watch key is answered, and the run ends well without its checks (it failed
    with "did not return an output" when every check output was required)."""
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 100, start_pk=1, seed=1))
    vchannel = collection.vchannels[1]
    key = store.keys.channel_watch(node.node_id, vchannel)
    kv = store.get(key)
    assert kv is not None
    store.cas(key, kv.version, replace(infos[vchannel], state=WatchState.TO_RELEASE))
    moved = infos[vchannel].lease_id + 1_000_000
    config = {"lease_id": moved, "node_id": node.node_id, "release": True, "watch_key": key}

    result = materialize_sync(instance, vchan, dsettings, vchannel, config)

    assert result.success
    assert not result.asset_materializations_for_node("sync_vchannel")
    assert not result.get_asset_check_evaluations()
    released = store.get_model(key, ChannelWatchInfo)
    assert released is not None and released.model.state is WatchState.RELEASE_SUCCESS
    assert channel_checkpoint(store, vchannel) is None


def test_a_sync_run_superseded_by_another_sync_of_its_channel_commits_nothing_and_does_not_fail(
    dsettings: Settings,
    system: System,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    tmp_path: Path,
) -> None:
    """A sync run in its own process stops after writing its binlogs; meanwhile another sync
    of the channel under the same lease (the node's loop) claims it and commits the range.
    The run then commits nothing, says so, and ends as a success with nothing materialized:
    a red run for a channel that is fine would send an operator looking for a fault."""
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 300, start_pk=1, seed=1))
    vchannel = collection.vchannels[0]
    config = {"lease_id": infos[vchannel].lease_id, "node_id": node.node_id}
    marker = tmp_path / "reached"
    child = subprocess.Popen(
        [sys.executable, "-c", SYNC_RUN, vchannel, json.dumps(config)],
        env=cli_env(dsettings, VCHAN_FAILPOINT="after_binlogs=stop", VCHAN_FAILPOINT_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_stopped(child, marker)
    lease = store.read_lease(vchannel)
    assert lease is not None
    other = SyncTask(system, collection, vchannel, lease, engine="local").run()
    assert other.rows > 0  # the channel's share of the 300
    child.send_signal(signal.SIGCONT)
    out, err = child.communicate(timeout=120)

    assert child.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["success"] and report["materialized"] == [], report
    assert any("another sync of" in m for m in report["logs"]), report["logs"]
    assert sum(s.model.num_rows for s in channel_segments(store, collection.id, vchannel)) == other.rows


# A sync run on an ephemeral instance in this process's child: settings from VCHAN_*,
# argv the vchannel and the run config; prints what the run did as one JSON line.
SYNC_RUN = """
import json, os, sys
import dagster as dg
from vchan_assets.config import Settings
from vchan_assets.defs.resources import VchanResource, pyspark_resource
from vchan_assets.defs.sync.assets import sync_vchannel

settings = Settings.from_env(os.environ)
vchannel, config = sys.argv[1], json.loads(sys.argv[2])
with dg.DagsterInstance.ephemeral() as instance:
    instance.add_dynamic_partitions("vchannels", [vchannel])
    result = dg.materialize(
        [sync_vchannel],
        partition_key=vchannel,
        instance=instance,
        resources={"vchan": VchanResource.from_settings(settings), "pyspark": pyspark_resource(settings)},
        run_config={"ops": {"sync_vchannel": {"config": config}}},
        raise_on_error=False,
    )
    print(json.dumps({
        "success": result.success,
        "materialized": [m.asset_key.to_user_string() for m in result.asset_materializations_for_node("sync_vchannel")],
        "logs": [e.user_message for e in instance.all_logs(result.run_id)],
    }))
"""


def test_a_sync_run_of_some_of_the_three_steps_is_refused_and_one_without_checks_evaluates_none(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 100, start_pk=1, seed=1))
    vchannel = collection.vchannels[0]
    config = {"lease_id": infos[vchannel].lease_id, "node_id": node.node_id}

    def run(selection: dg.AssetSelection) -> dg.ExecuteInProcessResult:
        return materialize_sync(instance, vchan, dsettings, vchannel, config, False, selection)

    partial = run(dg.AssetSelection.assets(BINLOGS.key))
    assert not partial.success
    failure = partial.failure_data_for_node("sync_vchannel")
    assert failure is not None and "select all three" in str(failure.error)
    assert channel_checkpoint(store, vchannel) is None

    bare = run(dg.AssetSelection.assets(BINLOGS.key, SEGMENTS.key, CHANNEL_CHECKPOINTS.key).without_checks())
    assert bare.success and not bare.get_asset_check_evaluations()
    assert len(bare.asset_materializations_for_node("sync_vchannel")) == 3
    assert store_checkpoint(store, vchannel) > 0


def test_a_sync_run_without_a_lease_in_its_config_runs_as_the_channels_current_writer(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
) -> None:
    # A materialization launched by hand from the UI has the default config (lease_id 0).
    watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 200, start_pk=1, seed=1))
    vchannel = collection.vchannels[0]
    assert materialize_sync(instance, vchan, dsettings, vchannel, {}).success
    assert store_checkpoint(store, vchannel) > 0
    lease = store.read_lease(vchannel)
    assert lease is not None
    store.delete(store.keys.channel_lease(vchannel))  # nobody may write it now
    result = materialize_sync(instance, vchan, dsettings, vchannel, {}, raise_on_error=False)
    assert not result.success
    failure = result.failure_data_for_node("sync_vchannel")
    assert failure is not None and f"{vchannel} has no channel lease" in str(failure.error)


def test_segment_table_writes_one_parquet_table_of_all_segments(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
    runtime: VchanRuntime,
) -> None:
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 300, start_pk=1, seed=1))
    for vchannel in collection.vchannels:
        config = {"lease_id": infos[vchannel].lease_id, "node_id": node.node_id}
        assert materialize_sync(instance, vchan, dsettings, vchannel, config).success
    result = dg.materialize([segment_table], instance=instance, resources={"vchan": vchan})
    assert result.success
    (mat,) = result.asset_materializations_for_node("segment_table")
    table = pq.read_table(str(mat.metadata["path"].value))
    assert table.num_rows == mat.metadata["segments"].value == len(runtime.segments())
    assert sum(table.column("num_rows").to_pylist()) == 300


def test_binlog_paths_check_fails_when_a_binlog_is_missing(
    instance: dg.DagsterInstance,
    vchan: VchanResource,
    dsettings: Settings,
    store: MetaStore,
    producer: Producer,
    collection: CollectionInfo,
    runtime: VchanRuntime,
) -> None:
    node, infos = watched_by_a_dagster_node(instance, vchan, store)
    producer.insert(collection.name, generate_rows(SCHEMA, 300, start_pk=1, seed=1))
    vchannel = collection.vchannels[0]
    config = {"lease_id": infos[vchannel].lease_id, "node_id": node.node_id}
    assert materialize_sync(instance, vchan, dsettings, vchannel, config).success
    victim = runtime.segments(vchannel)[0].binlog_files[0].path
    runtime.storage.delete(victim)
    outcome = runtime.check_binlog_paths(vchannel)
    assert not outcome.passed and victim in outcome.description
    # The row check compares binlog values with the log: it fails too, naming the file (a
    # check that raised instead would fail the whole sync step).
    rows = runtime.check_log_rows(vchannel)
    assert not rows.passed and victim in rows.description
