"""End to end on a real Dagster deployment: dagster-daemon + dagster-webserver as
subprocesses (DagsterService, what `vchan up` starts), a real etcd, Spark Connect,
real files; the daemon's sensors drive watch and sync. Then the webserver's GraphQL
API and a real headless Chromium look at what it did."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import dagster as dg
import psutil
import pytest
from dagster._core.scheduler.instigation import InstigatorTick, InstigatorType, TickStatus
from dagster._daemon.controller import RELOAD_WORKSPACE_INTERVAL

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.recovery import channel_checkpoint
from vchan_assets.defs.orphans import run_worker_pid
from vchan_assets.defs.query.assets import VISIBLE_SEGMENTS
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.sync.jobs import CHANNEL_TAG, DAGSTER_ADDRESS, LOOP_JOB, NODE_TAG, sync_job
from vchan_assets.defs.sync.loop import LOOP_RUNNING
from vchan_assets.defs.sync.sensor import dagster_nodes, not_busy, plan_syncs
from vchan_assets.deploy.service import (
    HEARTBEAT_STALE_AFTER,
    INSTANCE_CONFIG,
    REPO,
    DagsterService,
    daemon_state,
    graphql,
)
from vchan_assets.lifecycle.sort_tasks import unsorted_segments
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.embedded import pid_alive, read_record
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, CollectionInfo, MsgPosition, NodeSession, WatchState
from vchan_assets.status import collect_status
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing import waiting
from vchan_assets.testing.harness import SCHEMA as HARNESS_SCHEMA
from vchan_assets.testing.harness import PausableLoad, all_synced, exactly_once, owners
from vchan_assets.wal.producer import Producer, generate_rows

from .browser import FLAGS, chromium
from .helpers import SCHEMA, after_a_run_start, live_settings, running

wait_until = partial(waiting.wait_until, interval=0.25)  # many of its conditions ask the webserver
ARTIFACTS = REPO / "test-artifacts"
ROWS = 2_000
DELETES = 100


@dataclass
class Deployment:
    url: str
    settings: Settings
    store: MetaStore
    instance: dg.DagsterInstance
    collection: CollectionInfo
    heads: dict[str, MsgPosition]
    service: DagsterService
    producer: Producer


@pytest.fixture(scope="module")
def deployment(etcd, spark_remote: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("deployment")
    # The lifecycle step leaves fresh flushes to the sort sensor for the whole module: on a
    # loaded machine a sort run can take longer than the default 120 s to start, and a
    # segment the step sorted as a leftover is never a `sorted_segments` check (the UI test's).
    settings = replace(
        live_settings(tmp, "e2e", etcd.endpoint, spark_remote, session_ttl=5.0), sort_leftover_after=3600.0
    )
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(INSTANCE_CONFIG, home / "dagster.yaml")
    service = DagsterService(settings, dagster_home=home)
    with running(service) as (url, store, producer):
        # Created once both node sensors registered their nodes, as on a running deployment:
        # created before, both channels could go to the first node, and the coordinator's
        # balance then moved one (a release run and a watch run more, before any test).
        wait_until(
            lambda: len(_dagster_sessions(store)) == settings.dagster_datanodes,
            180,
            "the Dagster-hosted DataNodes registered",
            describe=lambda: _dagster_sessions(store),
        )
        collection = producer.create_collection("e2e", SCHEMA, [], num_channels=2)
        producer.insert(collection.name, generate_rows(SCHEMA, ROWS, start_pk=1, seed=1))
        heads = {
            v: a.position for v, a in producer.delete(collection.name, list(range(1, DELETES + 1))).items()
        }
        with dg.DagsterInstance.from_config(str(home)) as instance:
            yield Deployment(url, settings, store, instance, collection, heads, service, producer)


def test_sensors_watch_and_sync_every_channel_and_the_checks_pass(deployment: Deployment) -> None:
    store = deployment.store

    def committed() -> bool:
        for vchannel, head in deployment.heads.items():
            cp = channel_checkpoint(store, vchannel)
            if cp is None or cp.model.offset < head.offset:
                return False
        return True

    try:
        wait_until(committed, after_a_run_start(120), "both checkpoints to reach the log head")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {_where_syncs_stand(deployment, list(deployment.heads))}") from None
    instance = deployment.instance
    runs = instance.get_runs(dg.RunsFilter(job_name="sync"))
    assert runs and all(r.tags.get("vchan/channel") in deployment.collection.vchannels for r in runs)
    finished = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE)

    def sync_runs() -> list[tuple[str, str, str]]:
        return [
            (r.run_id[:8], r.status.value, r.tags.get("vchan/channel", "?"))
            for r in instance.get_runs(dg.RunsFilter(job_name="sync"))
        ]

    # A sync run requested before the nodes' loops started may still be queued behind the
    # other runs (a slot each for the two loops, the view, the lifecycle, the indexes): on a
    # loaded machine its process takes tens of seconds to start, so this waits on the runs'
    # states and, if they do not finish, says which were left in which state.
    wait_until(
        lambda: all(r.status in finished for r in instance.get_runs(dg.RunsFilter(job_name="sync"))),
        after_a_run_start(120),
        "the sync runs to finish",
        describe=sync_runs,
    )
    statuses = {r.run_id: r.status for r in instance.get_runs(dg.RunsFilter(job_name="sync"))}
    assert dg.DagsterRunStatus.SUCCESS in statuses.values()
    # A run that never started (`_never_started`) is the deployment working as configured.
    failed = [
        run.run_id
        for run in instance.get_runs(dg.RunsFilter(job_name="sync", statuses=[dg.DagsterRunStatus.FAILURE]))
        if not _never_started(run)
    ]
    assert not failed, _failures(instance, failed)
    checks = []
    for run_id in statuses:
        for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
            assert record.dagster_event is not None
            checks.append(record.dagster_event.event_specific_data)
    assert checks and all(c.passed for c in checks)  # type: ignore[union-attr]
    names = {c.check_name for c in checks}  # type: ignore[union-attr]
    assert names == {
        "binlog_rows_match_log",
        "no_duplicate_pks",
        "binlog_paths_exist",
        "checkpoint_monotonic",
    }


def test_the_query_view_of_every_vchannel_is_materialized_on_the_live_stack_with_passing_checks(
    deployment: Deployment,
) -> None:
    """The daemon's `query_view_sensor` requests `visible_segments` once the syncs wrote segment
    meta: each vchannel's view is materialized, serving every live row once (all rows are in
    the log or in growing segments here), and its checks pass. The UI's lineage has it
    downstream of the hand-off: `segments` -> `sorted_segments` -> `visible_segments`."""
    instance, vchannels = deployment.instance, deployment.collection.vchannels

    def served() -> dict[str, int]:
        out = {}
        for v in vchannels:
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=VISIBLE_SEGMENTS, asset_partitions=[v]), limit=1
            ).records
            if records and records[0].asset_materialization is not None:
                out[v] = int(str(records[0].asset_materialization.metadata["rows_served"].value))
        return out

    wait_until(
        lambda: sum(served().values()) == ROWS - DELETES,
        after_a_run_start(120),
        "a view of each vchannel serving every row",
    )
    checks = [
        record.dagster_event.event_specific_data
        for run in instance.get_runs(dg.RunsFilter(job_name="query_view"))
        for record in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        if record.dagster_event is not None
    ]
    assert {c.check_name for c in checks} == {"rows_served_once", "invisible_segments_bounded"}  # type: ignore[union-attr]
    assert all(c.passed for c in checks), [c.description for c in checks]  # type: ignore[union-attr]
    found = graphql(
        deployment.url,
        '{ assetNodes(assetKeys: [{path: ["visible_segments"]}]) { dependencyKeys { path } } }',
    )
    deps = {"/".join(d["path"]) for d in found["assetNodes"][0]["dependencyKeys"]}
    assert deps == {"segments", "sorted_segments", "compacted_segments"}


def _dagster_sessions(store: MetaStore) -> list[int]:
    """The Dagster-hosted nodes with a session in etcd."""
    found, _ = store.list_models(store.keys.datanode_session.prefix, NodeSession, skip_malformed=True)
    return sorted(d.model.node_id for d in found if d.model.address.startswith(DAGSTER_ADDRESS))


def _owners_settled(deployment: Deployment) -> bool:
    """Every channel of the collection watched (WatchSuccess) by a node whose loop runs (its
    run logged LOOP_RUNNING: a STARTED run may still be starting its Spark session), the
    channels spread over the nodes (the coordinator's balance done: a channel it moves later
    is synced by its new owner's watch run, not a loop), the watch run of each channel's
    current lease done, and no sync run in flight. The node's sensor writes WatchSuccess
    before the daemon creates the watch run it asked for: rows inserted in between were
    synced by that watch run, and the loop then had nothing to report (the flake of
    test_the_nodes_sync_loops_report_every_later_sync_with_passing_checks)."""
    instance, store = deployment.instance, deployment.store
    started = dg.RunsFilter(job_name=LOOP_JOB, statuses=[dg.DagsterRunStatus.STARTED])
    looping = {
        r.dagster_run.tags.get(NODE_TAG)
        for r in instance.get_run_records(started)
        if any(LOOP_RUNNING in e.user_message for e in instance.all_logs(r.dagster_run.run_id))
    }
    owners = set()
    for vchannel in deployment.collection.vchannels:
        lease = store.read_lease(vchannel)
        if lease is None or str(lease.node_id) not in looping:
            return False
        watch = store.get_model(store.keys.channel_watch(lease.node_id, vchannel), ChannelWatchInfo)
        if watch is None or watch.model.state is not WatchState.WATCH_SUCCESS:
            return False
        if not _watch_run_done(instance, vchannel, f"watch:{lease.node_id}:{vchannel}:{lease.lease_id}"):
            return False
        owners.add(lease.node_id)
    spread = len(owners) == min(len(deployment.collection.vchannels), len(_dagster_sessions(store)))
    in_flight = dg.RunsFilter(job_name=sync_job.name, statuses=[dg.DagsterRunStatus.QUEUED, *IN_FLIGHT])
    return spread and not instance.get_run_records(in_flight)


def _watch_run_done(instance: dg.DagsterInstance, vchannel: str, run_key: str) -> bool:
    """The watch run with `run_key` was created and has ended (a failed one too: the loop
    then syncs what it left)."""
    runs = instance.get_runs(dg.RunsFilter(job_name=sync_job.name, tags={CHANNEL_TAG: vchannel}))
    return any(r.tags.get("dagster/run_key", "").startswith(run_key) and r.is_finished for r in runs)


def _where_syncs_stand(deployment: Deployment, vchannels: list[str]) -> str:
    """Why the vchannels' checkpoints may not move: the runs of the loops and their logs and
    stderr, the latest checkpoint materializations, leases, live nodes, sync reasons, plans."""
    instance, store = deployment.instance, deployment.store
    runs = instance.get_runs(dg.RunsFilter(job_name=LOOP_JOB))
    latest = {}
    for v in vchannels:
        found = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("channel_checkpoints"), asset_partitions=[v]),
            limit=1,
        ).records
        latest[v] = (found[0].run_id if found else None, channel_checkpoint(store, v))
    owners = {v: store.read_lease(v) for v in vchannels}
    logs = {r.run_id[:8]: [e.user_message for e in instance.all_logs(r.run_id)][-8:] for r in runs}
    in_flight = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED, *IN_FLIGHT]))
    with VchanResource.from_settings(deployment.settings).open() as runtime:
        nodes = dagster_nodes(runtime)
        plans = not_busy(instance, plan_syncs(runtime))
        known = runtime.vchannels()
        reasons = {v: runtime.sync_reasons(runtime.status(v, known[v])) for v in vchannels}
    return (
        f"loop runs {[(r.run_id[:8], r.tags, r.status.value) for r in runs]}; latest {latest}; "
        f"leases {owners}; live dagster nodes {nodes}; sync reasons {reasons}; plans now {plans}; "
        f"runs in flight {[(r.job_name, r.run_id[:8], r.status.value) for r in in_flight]}; "
        f"loop logs {logs}; loop stderr {_compute_stderr(instance, runs)}"
    )


def _failures(instance: dg.DagsterInstance, run_ids: Sequence[str]) -> dict[str, list[str]]:
    """What each failed run said: its tags and its step and run failure messages."""
    kinds = {dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE}
    found = {}
    for run_id in run_ids:
        run = instance.get_run_by_id(run_id)
        said = [
            str(e.dagster_event.event_specific_data)[:2000] if e.dagster_event else e.user_message
            for e in instance.all_logs(run_id)
            if e.dagster_event is not None and e.dagster_event.event_type in kinds
        ]
        found[run_id[:8]] = [str(run.tags if run else {}), *said]
    return found


def _compute_stderr(
    instance: dg.DagsterInstance, runs: Sequence[dg.DagsterRun], tail: int = 4000
) -> dict[str, str]:
    """The end of each run's captured stderr (a stuck loop writes its threads' stacks there)."""
    found = {}
    for run in runs:
        for path in sorted((Path(instance.root_directory) / "storage" / run.run_id).rglob("*.err")):
            found[f"{run.run_id[:8]}/{path.name}"] = path.read_text(errors="replace")[-tail:]
    return found


def test_the_nodes_sync_loops_report_every_later_sync_with_passing_checks(deployment: Deployment) -> None:
    """After a channel's first sync (its watch run), its node's sync loop run syncs it: a
    change reaches the checkpoint with no new run, and the loop's materialization of
    `channel_checkpoints` for that partition reports the checkpoint etcd has, its checks
    passed. (After the query view test: these rows are more than it counts.)"""
    instance, store = deployment.instance, deployment.store
    wait_until(
        lambda: _owners_settled(deployment),
        after_a_run_start(120),
        "every channel watched by a node whose loop runs",
    )
    appended = deployment.producer.insert(
        deployment.collection.name, generate_rows(SCHEMA, 100, start_pk=ROWS + 5_001, seed=5)
    )

    def loops() -> set[str]:
        return {r.run_id for r in instance.get_runs(dg.RunsFilter(job_name=LOOP_JOB))}

    def reported_by_a_loop(vchannel: str, head: int) -> bool:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("channel_checkpoints"), asset_partitions=[vchannel]),
            limit=1,
        ).records
        mat = records[0].asset_materialization if records else None
        cp = channel_checkpoint(store, vchannel)
        return (
            mat is not None
            and cp is not None
            and cp.model.offset >= head
            and records[0].run_id in loops()
            and mat.metadata["checkpoint_offset"].value == cp.model.offset
        )

    try:
        wait_until(
            lambda: all(reported_by_a_loop(v, a.position.offset) for v, a in appended.items()),
            after_a_run_start(120),
            "the loops' materializations at the checkpoints past the new rows",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {_where_syncs_stand(deployment, list(appended))}") from None
    checks = [
        r.dagster_event.event_specific_data
        for run_id in loops()
        for r in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        if r.dagster_event is not None
    ]
    assert checks and all(c.passed for c in checks)  # type: ignore[union-attr]


def test_vchan_status_tells_a_hung_daemon_from_its_heartbeats(deployment: Deployment) -> None:
    """`vchan status` reads the daemon's health from the heartbeats its daemons write to the
    Dagster instance, not only from its pid: the running one is "up" with a recent
    heartbeat; looked at from HEARTBEAT_STALE_AFTER + 60 s later (the clock moved, the
    heartbeats not: a daemon alive but stopped), it is "hung" with a warning saying what
    to do."""
    catalog = Catalog(
        System(deployment.settings, deployment.store, Storage.from_settings(deployment.settings))
    )

    def daemon() -> str:
        return str(collect_status(catalog, orphans=False)["services"]["dagster_daemon"])

    wait_until(lambda: daemon().startswith("up"), 90, "the daemon's first heartbeat")
    assert "heartbeat" in daemon(), daemon()
    later = collect_status(catalog, now=time.time() + HEARTBEAT_STALE_AFTER + 60, orphans=False)
    assert later["services"]["dagster_daemon"].startswith("hung"), later["services"]
    (warning,) = [w for w in later["warnings"] if w["kind"] == "service_down"]
    assert "run `vchan up`: it replaces a hung daemon" in warning["message"], warning


def _register_a_node_nobody_keeps(store: MetaStore) -> int:
    """A Dagster-hosted node's session with nobody behind it, as the one a node sensor tick
    registers when the code server evaluates it while its daemon is being stopped (STOPPING
    here, so the coordinator gives it no channel meanwhile). Its node id."""
    from vchan_assets.model import SessionState

    node_id = IdAllocator(store, batch=1).alloc()
    now = time.time()
    record = NodeSession(node_id, f"{DAGSTER_ADDRESS}9", "0", now, SessionState.STOPPING, now)
    store.cas(store.keys.datanode_session(node_id), 0, record, lease=store.grant(60))
    return node_id


def _storage_creations(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The homes whose storage DagsterService creates from now on (it still creates them)."""
    created: list[Path] = []
    create = DagsterService._create_storage

    def recorded(service: DagsterService, env: dict[str, str]) -> None:
        created.append(service.home)
        create(service, env)

    monkeypatch.setattr(DagsterService, "_create_storage", recorded)
    return created


def test_vchan_up_restarts_a_hung_daemon_and_the_supervisor_sees_it(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon whose process is alive but whose heartbeats stopped is hung: `missing()` (what
    `vchan up --supervise` checks) lists it, and `start()` (what `vchan up` and the supervisor
    run) replaces it and leaves the webserver alone. Judged from HEARTBEAT_STALE_AFTER + 60 s
    later: the clock moved, the heartbeats not. No Dagster-hosted node's session outlives the
    replaced daemon (one left would hold for its TTL, and be given channels), and the heal
    starts the daemon without creating the storage the running webserver has opened."""
    service = deployment.service
    later = time.time() + HEARTBEAT_STALE_AFTER + 60
    healer = DagsterService(deployment.settings, dagster_home=service.dagster_home)
    daemon, web = json.loads(service.state_file.read_text())["pids"]
    wait_until(
        lambda: daemon_state(daemon, service.dagster_home, time.time()).startswith("up"), 90, "a heartbeat"
    )
    assert healer.missing() == []
    assert healer.missing(now=later) == ["dagster-daemon (hung)"]
    left_behind = _register_a_node_nobody_keeps(deployment.store)
    created = _storage_creations(monkeypatch)

    healer.start(now=later)

    new_daemon, new_web = json.loads(service.state_file.read_text())["pids"]
    assert new_daemon != daemon and not pid_alive(daemon) and pid_alive(new_daemon)
    assert new_web == web and pid_alive(web)
    assert left_behind not in _dagster_sessions(deployment.store)
    assert created == []
    wait_until(
        lambda: daemon_state(new_daemon, service.dagster_home, time.time()).startswith("up"),
        90,
        "the new daemon's first heartbeat",
    )


ASSET_GRAPH = """
{
  assetNodes(group: {groupName: "vchannel_sync", repositoryName: "__repository__",
                     repositoryLocationName: "vchan_assets"}) {
    assetKey { path }
    dependencyKeys { path }
    isPartitioned
    partitionKeys
  }
}
"""


def test_graphql_returns_the_lineage_and_the_vchannel_partitions(deployment: Deployment) -> None:
    wait_until(
        lambda: len(deployment.instance.get_dynamic_partitions("vchannels")) >= 2,
        60,
        "the vchannel partitions",
    )
    nodes = {"/".join(n["assetKey"]["path"]): n for n in graphql(deployment.url, ASSET_GRAPH)["assetNodes"]}
    assert set(nodes) == {"binlogs", "segments", "channel_checkpoints"}
    deps = {k: {"/".join(d["path"]) for d in n["dependencyKeys"]} for k, n in nodes.items()}
    assert deps == {"binlogs": set(), "segments": {"binlogs"}, "channel_checkpoints": {"segments"}}
    for node in nodes.values():
        assert node["isPartitioned"]
        assert set(deployment.collection.vchannels) <= set(node["partitionKeys"])
    catalog = graphql(
        deployment.url, '{ assetNodes(assetKeys: [{path: ["segment_table"]}]) { dependencyKeys { path } } }'
    )
    assert [d["path"] for d in catalog["assetNodes"][0]["dependencyKeys"]] == [["channel_checkpoints"]]


def test_headless_chromium_renders_the_three_assets_on_the_lineage_page(deployment: Deployment) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is required (make system-deps installs it)"
    page = f"{deployment.url}/locations/vchan_assets/asset-groups/vchannel_sync"
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "asset-lineage.png"
    with tempfile.TemporaryDirectory() as profile:
        flags = [*FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000"]
        dom = subprocess.run(
            [chromium, *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        subprocess.run(
            [chromium, *flags, f"--screenshot={screenshot}", page],
            capture_output=True,
            timeout=120,
            check=True,
        )
    (ARTIFACTS / "asset-lineage.html").write_text(dom)
    for asset in ("binlogs", "segments", "channel_checkpoints"):
        assert asset in dom, f"{asset} not rendered on {page}"
    assert screenshot.stat().st_size > 10_000
    assert Path(screenshot).exists()


MATERIALIZATION_METADATA = """
{
  assetOrError(assetKey: {path: ["binlogs"]}) {
    ... on Asset {
      assetMaterializations(limit: 20) {
        partition
        metadataEntries { label __typename }
      }
    }
  }
}
"""


def test_numeric_sync_metadata_is_typed_so_the_ui_plots_it(deployment: Deployment) -> None:
    """The asset page's Plots tab draws IntMetadataEntry/FloatMetadataEntry values over time
    per partition: rows, bytes and seconds of every sync must arrive typed that way."""
    wait_until(
        lambda: graphql(deployment.url, MATERIALIZATION_METADATA)["assetOrError"]["assetMaterializations"],
        after_a_run_start(120),
        "a binlogs materialization",
    )
    mats = graphql(deployment.url, MATERIALIZATION_METADATA)["assetOrError"]["assetMaterializations"]
    assert {m["partition"] for m in mats} <= set(deployment.collection.vchannels)
    for mat in mats:
        kinds = {e["label"]: e["__typename"] for e in mat["metadataEntries"]}
        assert kinds["rows"] == kinds["bytes"] == kinds["end_offset"] == "IntMetadataEntry", kinds
        assert kinds["seconds"] == "FloatMetadataEntry", kinds
        assert kinds["reason"] == "TextMetadataEntry", kinds


PLOTS_BUTTON = "[...document.querySelectorAll('button')].some(b => b.textContent.trim() === 'Plots')"
PLOTTED = "document.querySelectorAll('canvas').length"


def test_the_binlogs_asset_page_plots_rows_bytes_and_seconds(deployment: Deployment) -> None:
    """A real headless Chromium on the asset page: its Metadata section, switched to Plots
    and Events (values over time), draws one chart per numeric entry: rows, bytes and seconds
    of the syncs. Text metadata would have no chart. Screenshot in test-artifacts/."""
    wait_until(
        lambda: graphql(deployment.url, MATERIALIZATION_METADATA)["assetOrError"]["assetMaterializations"],
        after_a_run_start(120),
        "a binlogs materialization",
    )
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium() as page:
        page.open(f"{deployment.url}/assets/binlogs")
        page.wait_for(PLOTS_BUTTON, 90, "the asset page's metadata section")
        assert page.click_text("button", "Plots")
        page.wait_for(f"{PLOTTED} >= 4", 60, "the metadata plots")
        assert page.click_text("button", "Events")  # over time, rather than by partition
        page.wait_for(
            f"!document.body.innerText.includes('Loading plots') && {PLOTTED} >= 4", 60, "the plots"
        )
        text = page.text()
        section = text[text.index("\nMetadata\n") :].split("\nLineage\n")[0]
        for label in ("rows", "bytes", "seconds", "end_offset"):
            assert label in section.split(), f"no {label!r} plot on the asset page: {section[:500]}"
        assert "reason" not in section.split(), "a text entry has no plot"
        page.screenshot(ARTIFACTS / "binlogs-plots.png")
    assert (ARTIFACTS / "binlogs-plots.png").stat().st_size > 10_000


HEALTH = """
{
  assetNodes(assetKeys: [{path: ["segment_table"]}, {path: ["channel_checkpoints"]}]) {
    assetKey { path }
    freshnessStatusInfo { freshnessStatus }
    automationCondition { label }
  }
}
"""
CHECK_EXECUTIONS = """
query ($asset: AssetKeyInput!, $check: String!) {
  assetCheckExecutions(assetKey: $asset, checkName: $check, limit: 5) {
    runId
    status
    evaluation { success }
  }
}
"""
CHECKS = """
{ assetNodes { assetKey { path } assetChecksOrError { ... on AssetChecks { checks { name blocking } } } } }
"""
# The checks every live deployment evaluates: in each sync, in each view run, every minute.
LIVE_CHECKS = {
    "binlogs": {"binlog_rows_match_log", "no_duplicate_pks"},
    "segments": {"binlog_paths_exist"},
    "channel_checkpoints": {"checkpoint_monotonic", "checkpoints_fresh"},
    "visible_segments": {"rows_served_once", "invisible_segments_bounded"},
    "sorted_segments": {"sorted_rows_conserved"},  # once the collection is flushed (below)
}


def _check_executions(url: str, asset: str, check: str) -> list[dict[str, Any]]:
    """The check's last executions, newest first, as the UI lists them."""
    variables = {"asset": {"path": [asset]}, "check": check}
    return list(graphql(url, CHECK_EXECUTIONS, variables)["assetCheckExecutions"])


def _never_started(run: dg.DagsterRun | None) -> bool:
    """Whether Dagster failed the run because its process did not start within run
    monitoring's start timeout (dagster.yaml; a starved machine): it synced nothing, its
    checks were planned and never evaluated, and its sync, if still needed, is requested
    again."""
    return run is not None and run.tags.get("dagster/failure_reason") == "START_TIMEOUT"


def _check_passed(deployment: Deployment, asset: str, check: str) -> bool:
    """Whether the check's last evaluation passed. An execution of a run that never started
    (planned at the run's launch, failed with it) is passed over: the check was not evaluated
    there, and an evaluation before or after it says how the asset is."""
    for execution in _check_executions(deployment.url, asset, check):
        if execution["status"] == "EXECUTION_FAILED" and _never_started(
            deployment.instance.get_run_by_id(execution["runId"])
        ):
            continue
        return bool(execution["status"] == "SUCCEEDED")
    return False


def _sensor_ticks(instance: dg.DagsterInstance, sensor: str, limit: int) -> list[InstigatorTick]:
    """The last `limit` ticks of `sensor`, newest first ([] if it never ticked)."""
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.name == sensor:
            return list(instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=limit))
    return []


def _check_trace(deployment: Deployment, asset: str, check: str) -> str:
    """What a check that never passed last looked like (each execution's run: its job, status
    and failure), and for the sort's check what would have run it: the sort runs, the sort
    sensor's last ticks and the segments not yet sorted."""
    instance = deployment.instance
    found = _check_executions(deployment.url, asset, check)
    lines = [f"last executions of {asset}:{check}: {found}"]
    for execution in found:
        run = instance.get_run_by_id(execution["runId"]) if execution["runId"] else None
        if run is not None and run.status != dg.DagsterRunStatus.SUCCESS:
            lines.append(
                f"- run {run.run_id[:8]} of {run.job_name} {run.status.value}: {_failures(instance, [run.run_id])}"
            )
    if asset != "sorted_segments":
        return "\n".join(lines)
    for record in instance.get_run_records(dg.RunsFilter(job_name="sort"), limit=5):
        run = record.dagster_run
        lines.append(f"- sort run {run.run_id[:8]} {run.status.value} created {record.create_timestamp}")
    for tick in _sensor_ticks(instance, "sort_sensor", 8):
        reason = tick.skip_reason or tick.run_ids or tick.error
        lines.append(f"- sort_sensor tick at {tick.timestamp:.0f}: {tick.status.value} {reason}")
    for record in instance.get_run_records(dg.RunsFilter(job_name=LOOP_JOB, statuses=IN_FLIGHT), limit=5):
        lines.append(f"- sync loop run {record.dagster_run.run_id[:8]} {record.dagster_run.status.value}")
    with VchanResource.from_settings(deployment.settings).open() as runtime:
        unsorted = [(s.id, s.vchannel, s.last_flush_ts) for s in unsorted_segments(runtime.store)]
        sealed = [s.id for s in runtime.segments() if s.state.value == "Sealed"]
    lines.append(f"at {time.time():.0f}: unsorted flushed segments {unsorted}, sealed ones {sealed}")
    return "\n".join(lines)


def _automation_trace(instance: dg.DagsterInstance, asset: str, ticks: int = 5) -> str:
    """The last `ticks` evaluations of `asset`'s automation condition, each as its tree of
    labels with what each node held true for (a bool, or the partitions of an upstream
    asset): what a failed wait says about why the condition did not fire."""

    def tree(evaluation, depth: int = 0) -> list[str]:  # type: ignore[no-untyped-def]
        snapshot = evaluation.condition_snapshot
        label = snapshot.label or snapshot.name or snapshot.description
        lines = [f"{'  ' * depth}{label}: {evaluation.true_subset.value!r:.100}"]
        for child in evaluation.child_evaluations:
            lines += tree(child, depth + 1)
        return lines

    records = instance.schedule_storage.get_auto_materialize_asset_evaluations(  # type: ignore[union-attr]
        dg.AssetKey(asset), limit=ticks
    )
    lines = [f"last {len(records)} automation evaluations of {asset}:"]
    for record in records:
        lines.append(f"- evaluation {record.evaluation_id} at {record.timestamp:.0f}")
        lines += tree(record.get_evaluation_with_run_ids().evaluation, 1)
    return "\n".join(lines)


def test_the_ui_shows_automation_freshness_checks_and_the_hand_off_assets(deployment: Deployment) -> None:
    """The live deployment's health as a Dagster user sees it. Declarative automation
    (`vchan_automation`) materializes `segment_table` after the syncs, and the asset is fresh
    under its freshness policy; every check of the sync, the view, the sort (the collection is
    flushed, so its segments get sorted) and the checkpoint freshness check has been evaluated
    and passed; the exactly-once checks are blocking. A real headless Chromium renders the
    asset graph (its groups), the asset catalog with the index and hand-off assets
    (`segment_indexes`, `visible_segments`) and the automated catalog table, and the catalog
    table's page; screenshots in test-artifacts/."""
    url, instance = deployment.url, deployment.instance
    deployment.producer.flush(deployment.collection.name)

    def automated() -> bool:
        records = instance.fetch_materializations(dg.AssetKey("segment_table"), limit=5).records
        runs = [instance.get_run_by_id(r.run_id) for r in records if r.run_id]
        return any(r is not None and r.tags.get("dagster/sensor_name") == "vchan_automation" for r in runs)

    try:
        wait_until(automated, after_a_run_start(120), "segment_table materialized by the automation sensor")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_automation_trace(instance, 'segment_table')}") from None
    nodes = {"/".join(n["assetKey"]["path"]): n for n in graphql(url, HEALTH)["assetNodes"]}
    assert "exactly-once checks passed" in nodes["segment_table"]["automationCondition"]["label"]

    def freshness() -> str:
        for node in graphql(url, HEALTH)["assetNodes"]:
            if node["assetKey"]["path"] == ["segment_table"] and node["freshnessStatusInfo"]:
                return str(node["freshnessStatusInfo"]["freshnessStatus"])
        return ""

    wait_until(lambda: freshness() == "HEALTHY", 120, "segment_table fresh under its freshness policy")
    blocking = {
        check["name"]: check["blocking"]
        for node in graphql(url, CHECKS)["assetNodes"]
        for check in (node["assetChecksOrError"] or {}).get("checks", [])
    }
    assert (
        blocking["no_duplicate_pks"]
        and blocking["checkpoint_monotonic"]
        and blocking["sorted_rows_conserved"]
    )
    assert not blocking["checkpoints_fresh"] and not blocking["index_recall"]

    ARTIFACTS.mkdir(exist_ok=True)
    with chromium() as page:
        # The global lineage shows one box per group at its default zoom, not the assets:
        # the groups there, the assets by name in the catalog's list.
        page.open(f"{url}/asset-groups")
        for group in ("vchannel_sync", "segment_lifecycle", "catalog"):
            page.wait_for(f"document.body.innerText.includes('{group}')", 90, f"{group} on the asset graph")
        page.screenshot(ARTIFACTS / "asset-graph-health.png")
        page.open(f"{url}/assets")
        for asset in ("segment_indexes", "visible_segments", "segment_table", "sorted_segments"):
            page.wait_for(f"document.body.innerText.includes('{asset}')", 90, f"{asset} in the asset catalog")
        page.screenshot(ARTIFACTS / "asset-catalog.png")
        page.open(f"{url}/assets/segment_table")
        page.wait_for(  # its description, and no "Never materialized"
            "document.body.innerText.includes('Every segment of every collection as one table')"
            " && !document.body.innerText.includes('Never materialized')",
            90,
            "segment_table's page",
        )
        page.screenshot(ARTIFACTS / "segment-table-freshness.png")
        page.open(f"{url}/assets/channel_checkpoints?view=checks")
        page.wait_for(
            "document.body.innerText.includes('checkpoints_fresh')", 90, "the checks of checkpoints"
        )
        checks_text = page.text()
        page.screenshot(ARTIFACTS / "checkpoint-checks.png")
    for check in ("checkpoints_fresh", "checkpoint_monotonic"):
        assert check in checks_text, checks_text[:2000]
    assert (ARTIFACTS / "asset-graph-health.png").stat().st_size > 10_000
    # Last: the sort of the segments flushed above (its sensor's tick, then a run) went on
    # while the browser looked at the pages, which show none of these evaluations.
    for asset, checks in LIVE_CHECKS.items():
        for check in sorted(checks):
            wait_until(
                lambda a=asset, c=check: _check_passed(deployment, a, c),
                420,
                f"{asset}:{check} evaluated, passed",
                describe=lambda a=asset, c=check: _check_trace(deployment, a, c),
            )


def _kill_daemon(pid: int) -> None:
    """kill -9 of the daemon's process group: its code server and runs too."""
    os.killpg(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 30, "the daemon to die")


# The faults of the schedule: a number of each kind, not a duration (under load each takes
# longer); CHAOS_CEILING only fails a schedule that cannot get them done.
CHAOS_FAULTS = {"kill_run_worker": 2, "kill_daemon": 1}
CHAOS_CEILING = 600.0
CHAOS_SEED = int(os.environ.get("VCHAN_CHAOS_SEED", "20261123"))
IN_FLIGHT = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]


def _kill_a_run_worker(instance: dg.DagsterInstance, rng: random.Random, timeout: float = 20.0) -> bool:
    """kill -9 of the process of a sync run or of a node's sync loop run in flight (its pid
    from the run's engine event), waiting up to `timeout` for one; False if none came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [
            r
            for job in (sync_job.name, LOOP_JOB)
            for r in instance.get_run_records(dg.RunsFilter(job_name=job, statuses=IN_FLIGHT))
        ]
        pids = [p for r in records if (p := run_worker_pid(instance, r.dagster_run.run_id)) and pid_alive(p)]
        if pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
            return True
        time.sleep(0.1)
    return False


def _kill_and_restart_the_daemon(deployment: Deployment) -> list[str]:
    """kill -9 of the daemon's process group (its code server and runs too), then `vchan up`'s
    heal: DagsterService.start() starts the daemon again, and only the daemon (the webserver
    keeps its pid and URL). The runs in flight at the kill (orphaned: to be marked failed)."""
    service = deployment.service
    daemon, web = json.loads(service.state_file.read_text())["pids"]
    in_flight = dg.RunsFilter(job_name=LOOP_JOB, statuses=IN_FLIGHT)
    _kill_daemon(daemon)
    orphaned = [r.dagster_run.run_id for r in deployment.instance.get_run_records(in_flight)]
    url = DagsterService(deployment.settings, dagster_home=service.dagster_home).start()
    new_daemon, new_web = json.loads(service.state_file.read_text())["pids"]
    assert url == deployment.url and new_web == web and pid_alive(web)
    assert new_daemon != daemon and pid_alive(new_daemon)
    return orphaned


def _daemon_code_servers(daemon: psutil.Process) -> set[int]:
    """The pids of the code servers the daemon started (its `dagster api grpc` children)."""
    servers = set()
    for child in daemon.children():
        with contextlib.suppress(psutil.Error):
            if "api grpc" in " ".join(child.cmdline()):
                servers.add(child.pid)
    return servers


def _last_good_tick(instance: dg.DagsterInstance, sensor: str) -> float:
    """When the daemon last evaluated `sensor` without an error (0 if never)."""
    good = (TickStatus.SUCCESS, TickStatus.SKIPPED)
    return max((t.timestamp for t in _sensor_ticks(instance, sensor, 10) if t.status in good), default=0.0)


def test_the_daemon_keeps_its_code_server_and_starts_a_new_one_when_it_is_killed(
    deployment: Deployment,
) -> None:
    """Dagster's daemon replaces its code server every minute; `vchan up`'s keeps it while it
    lives (and with it the DataCoord sensor's segment meta in memory): once the daemon has
    lived past that minute, it has one code server, the one it started with. Killed with -9,
    the code server is replaced at the daemon's next check, and the sensors tick again
    through the new one."""
    daemon = psutil.Process(int(read_record(deployment.service.state_file)["pids"][0]))
    # The daemon the earlier tests restarted is minutes old by now: this waits only if not.
    wait_until(
        lambda: time.time() - daemon.create_time() > RELOAD_WORKSPACE_INTERVAL + 5,
        RELOAD_WORKSPACE_INTERVAL + 10,
        "the daemon to live past the interval of Dagster's reload",
    )
    servers = {
        pid: psutil.Process(pid).create_time() - daemon.create_time() for pid in _daemon_code_servers(daemon)
    }
    assert len(servers) == 1, f"the daemon's code servers, seconds after its start: {servers}"
    [(server, started_after)] = servers.items()
    assert started_after < RELOAD_WORKSPACE_INTERVAL, (
        f"a code server started {started_after:.0f} s after the daemon"
    )

    os.kill(server, signal.SIGKILL)
    killed = time.time()
    wait_until(
        lambda: _daemon_code_servers(daemon) - {server},
        30,
        "a new code server after the kill",
        describe=lambda: _daemon_code_servers(daemon),
    )
    wait_until(
        lambda: _last_good_tick(deployment.instance, "sync_sensor") > killed + 1,
        60,
        "a tick of the sync sensor through the new code server",
        describe=lambda: _last_good_tick(deployment.instance, "sync_sensor") - killed,
    )


def test_chaos_kill_9_of_the_daemon_and_of_run_workers_loses_and_duplicates_nothing(
    deployment: Deployment,
) -> None:
    """Dagster-hosted DataNodes and DataCoord under a producer, with a seeded schedule of
    kill -9 of sync run workers (mid-sync: their runs are orphaned, failed by the
    orphaned-runs sensor, and requested again) and of the whole daemon (restarted as
    `vchan up` does, and only the daemon: the webserver keeps its pid and URL; its nodes'
    sessions expire and their channels move). Afterwards every row and delete is in the live
    segments exactly once, value by value, every channel caught up, and every loop run a
    daemon kill orphaned is marked failed. VCHAN_CHAOS_SEED picks another schedule."""
    store, settings = deployment.store, deployment.settings
    storage = Storage.from_settings(settings)
    info = deployment.producer.create_collection("chaos", HARNESS_SCHEMA, [], num_channels=2)
    wait_until(
        lambda: owners(store, list(info.vchannels)),
        after_a_run_start(60),
        "the chaos collection's channels watched",
    )
    rng = random.Random(CHAOS_SEED)
    load = PausableLoad(deployment.producer, info, rows=40, period=0.2)
    faults: Counter[str] = Counter()
    orphaned: list[str] = []
    load.start()
    try:
        ends = time.monotonic() + CHAOS_CEILING
        while any(faults[kind] < n for kind, n in CHAOS_FAULTS.items()):
            assert time.monotonic() < ends, f"only {dict(faults)} in {CHAOS_CEILING:.0f}s"
            # Two run workers, then the daemon: both kinds in the shortest schedule;
            # the seed picks the victims and the gaps.
            if sum(faults.values()) % 3 == 2:
                orphaned += _kill_and_restart_the_daemon(deployment)
                faults["kill_daemon"] += 1
            elif _kill_a_run_worker(deployment.instance, rng):
                faults["kill_run_worker"] += 1
            time.sleep(rng.uniform(1.0, 4.0))
    finally:
        load.stop()
    deployment.producer.time_tick(info.name)
    wait_until(
        lambda: all_synced(store, storage, [info]),
        after_a_run_start(120),
        f"every channel caught up after {dict(faults)}",
    )
    tally = exactly_once(store, storage, info, load.produced)
    print(f"chaos under Dagster: {dict(faults)}; {tally.describe()}")  # shown with pytest -rP
    assert tally.ok, tally.describe()
    assert faults == CHAOS_FAULTS, faults

    def failed(run_id: str) -> bool:  # the orphaned-runs sensor, or run monitoring
        run = deployment.instance.get_run_by_id(run_id)
        return run is not None and run.status == dg.DagsterRunStatus.FAILURE

    for run_id in orphaned:
        wait_until(
            lambda r=run_id: failed(r),
            after_a_run_start(30),
            f"the loop run {run_id} orphaned by a daemon kill failed",
        )


def test_a_webserver_killed_9_is_started_again_by_vchan_up_and_serves_the_same_history(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the webserver's process group (its code server too): the service reports it
    missing, and `vchan up`'s heal (DagsterService.start()) starts a new webserver, and only
    it (the daemon keeps its pid; the storage it opened is not created again), whose UI
    serves the runs recorded before the kill."""
    service = deployment.service
    daemon, web = json.loads(service.state_file.read_text())["pids"]
    runs_before = graphql(deployment.url, RUN_COUNT)["runsOrError"]["count"]
    os.killpg(web, signal.SIGKILL)
    wait_until(lambda: not pid_alive(web), 30, "the webserver to die")
    assert service.missing() == ["dagster-webserver"]

    created = _storage_creations(monkeypatch)

    url = DagsterService(deployment.settings, dagster_home=service.dagster_home).start()
    assert created == []

    new_daemon, new_web = json.loads(service.state_file.read_text())["pids"]
    assert new_daemon == daemon and pid_alive(daemon)
    assert new_web != web and pid_alive(new_web)
    assert graphql(url, RUN_COUNT)["runsOrError"]["count"] >= runs_before > 0
    deployment.url = url


RUN_COUNT = "{ runsOrError { ... on Runs { count } } }"


def test_vchan_down_makes_the_dagster_hosted_nodes_leave_at_once(deployment: Deployment) -> None:
    """Last in this module: it stops the deployment as `vchan down` does (SIGTERM to the
    daemon's process group, run workers included). Each node's sync loop says STOPPING and
    revokes its session: the nodes' sessions are gone within seconds, not after their TTL
    (60 s at least for a Dagster-hosted node, which nothing refreshes once the daemon is
    down)."""
    store = deployment.store

    def dagster_sessions() -> list[int]:
        return _dagster_sessions(store)

    started = dg.RunsFilter(job_name=LOOP_JOB, statuses=[dg.DagsterRunStatus.STARTED])

    def looping() -> bool:
        """Every node's loop op runs, for 2 s at least (after the chaos test, loop runs start
        again): a run interrupted while it still starts (before its op) cannot leave, and
        its node's session waits for its TTL."""
        instance = deployment.instance
        with_loop = set()
        for record in instance.get_run_records(started):
            steps = instance.all_logs(record.dagster_run.run_id, of_type=dg.DagsterEventType.STEP_START)
            if steps and time.time() - steps[0].timestamp > 2.0:
                with_loop.add(record.dagster_run.tags.get(NODE_TAG))
        sessions = dagster_sessions()
        return bool(sessions) and all(str(n) in with_loop for n in sessions)

    wait_until(looping, after_a_run_start(120), "every node's sync loop op running")
    nodes = dagster_sessions()
    stopped = time.monotonic()
    deployment.service.stop(stop_spark=False)

    wait_until(lambda: not dagster_sessions(), 20, f"the sessions of nodes {nodes} gone")
    print(f"node sessions gone {time.monotonic() - stopped:.1f} s after the stop began")
