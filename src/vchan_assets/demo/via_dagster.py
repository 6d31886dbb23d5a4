"""`vchan demo` through Dagster: the real daemon's sensors drive watch and sync.

Starts the embedded etcd, a local Spark Connect server, dagster-daemon and
dagster-webserver (DAGSTER_HOME=$VCHAN_HOME/dagster/instance); creates a collection with 4 vchannels;
the two Dagster-hosted DataNodes (sensors `datanode_1`, `datanode_2`) register, the
DataCoord sensor assigns the channels; produces rows and deletes; the sync sensor
requests sync runs; flushes and waits for the flush state; then reads the asset check
results the sync runs recorded, materializes `segment_table`, re-reads every binlog
with pyarrow (the direct demo's check), and prints a summary. Then it stops what it
started, unless --keep, and its last lines say what it stopped and what is still running
(with --keep: the UI address, and `vchan down` to stop it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import dagster as dg
from rich.console import Console
from rich.table import Table

from vchan_assets.config import Settings
from vchan_assets.datacoord.channel_manager import ChannelManager
from vchan_assets.defs.cluster.datanodes import DAGSTER_ADDRESS
from vchan_assets.defs.lifecycle.assets import segment_lifecycle
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.sync.assets import segment_table
from vchan_assets.defs.sync.jobs import CHANNEL_TAG, LOOP_JOB
from vchan_assets.demo.direct import (
    DemoCheckError,
    DemoOptions,
    DemoProcess,
    _summary,
    check_binlogs,
    check_index_and_search,
    check_lifecycle,
    check_read,
    create_demo_collection,
    ending,
    etcd_process,
    produce_demo_data,
)
from vchan_assets.deploy.processes import wait_until
from vchan_assets.deploy.service import DagsterService
from vchan_assets.model import CollectionInfo, NodeSession, WatchState
from vchan_assets.stack import Stack
from vchan_assets.wal.producer import Producer

DEMO_SYNC_MAX_AGE = 2.0  # demo: sync what is older than 2 s (production: 600 s)


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """`wait_until`, failing the demo (DemoCheckError) on a timeout."""
    try:
        return wait_until(predicate, timeout, what, interval=0.5)
    except TimeoutError:
        raise DemoCheckError(f"timed out after {timeout:.0f}s waiting for {what}") from None


def latest_checks(instance: dg.DagsterInstance, vchannels: list[str]) -> dict[tuple[str, str], bool]:
    """(vchannel, check) -> passed, from the most recent sync of each channel that ran checks:
    a sync run of the channel, or a sync of it in its node's sync loop run (the check's
    partition names the channel there)."""
    found: dict[tuple[str, str], tuple[float, bool]] = {}
    runs = [
        *instance.get_runs(dg.RunsFilter(job_name="sync", statuses=[dg.DagsterRunStatus.SUCCESS])),
        *instance.get_runs(dg.RunsFilter(job_name=LOOP_JOB)),
    ]
    for run in runs:
        for record in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
            assert record.dagster_event is not None
            data = record.dagster_event.event_specific_data
            vchannel = data.partition or run.tags.get(CHANNEL_TAG, "")  # type: ignore[union-attr]
            key = (vchannel, data.check_name)  # type: ignore[union-attr]
            if vchannel in vchannels and (key not in found or found[key][0] <= record.timestamp):
                found[key] = (record.timestamp, bool(data.passed))  # type: ignore[union-attr]
    return {key: passed for key, (_, passed) in found.items()}


def _dagster_nodes(stack: Stack) -> list[int]:
    store = stack.store
    found, _ = store.list_models(store.keys.datanode_session.prefix, NodeSession, skip_malformed=True)
    return sorted(d.model.node_id for d in found if d.model.address.startswith(DAGSTER_ADDRESS))


def _all_watched(manager: ChannelManager, info: CollectionInfo) -> bool:
    states = manager.assignments()
    return all(
        any(state is WatchState.WATCH_SUCCESS for _, state in states.get(v, [])) for v in info.vchannels
    )


def _runs_in_flight(instance: dg.DagsterInstance, info: CollectionInfo) -> bool:
    statuses = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
    filters = dg.RunsFilter(job_name="sync", statuses=statuses, tags={CHANNEL_TAG: list(info.vchannels)})
    return bool(instance.get_runs(filters))


def _report_checks(console: Console, info: CollectionInfo, checks: dict[tuple[str, str], bool]) -> None:
    """Print the latest asset checks of every vchannel; DemoCheckError unless all passed."""
    table = Table(title="asset checks (latest sync of each vchannel)")
    names = sorted({c for _, c in checks})
    table.add_column("vchannel")
    for c in names:
        table.add_column(c)
    for v in info.vchannels:
        table.add_row(v, *("passed" if checks.get((v, c)) else "[red]FAILED/missing" for c in names))
    console.print(table)
    missing = [v for v in info.vchannels if not any((v, c) in checks for c in names)]
    failed = sorted((c, v) for (v, c), passed in checks.items() if not passed)
    if not checks or missing or failed:
        problems = [f"{c} FAILED on {v}" for c, v in failed]
        if missing:
            problems.append(f"no check ran for {', '.join(missing)} (no successful sync run of it)")
        raise DemoCheckError(
            f"asset checks did not all pass: {'; '.join(problems)}; the Dagster UI shows each "
            "check's description and metadata on the vchannel's partition"
        )


def _spark_remote(service: DagsterService, settings: Settings) -> str | None:
    state = service.recorded() or {}
    return str(state.get("spark_remote") or settings.spark_remote or "") or None


def _lifecycle_assets(console: Console, settings: Settings) -> None:
    """Materialize the segment lifecycle twice (sort/mix, then L0 into the sorted
    segments), GC with a short drop tolerance, and print what each step did."""
    quick = VchanResource.from_settings(
        replace(settings, gc_interval=0.5, gc_drop_tolerance=0.5, time_travel=0.5)
    )
    with dg.DagsterInstance.ephemeral() as instance:
        for step in (1, 2):
            time.sleep(1.0)  # the dropped segments pass the drop tolerance
            result = dg.materialize(
                [segment_lifecycle],
                instance=instance,
                resources={"vchan": quick},
                run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
            )
            meta = {
                m.asset_key.path[-1]: m.metadata
                for m in result.asset_materializations_for_node("segment_lifecycle")
            }
            compacted = {k: v.value for k, v in meta["compacted_segments"].items()}
            gc: dict[str, Any] = {k: v.value for k, v in meta["garbage_collection"].items()}
            checks = ", ".join(
                f"{c.check_name} {'passed' if c.passed else 'FAILED'}"
                for c in result.get_asset_check_evaluations()
            )
            console.print(
                f"lifecycle step {step}: {compacted['completed']} compactions completed "
                f"({compacted['rows_in']} rows in, {compacted['rows_out']} out); GC removed "
                f"{gc['dropped_segments_deleted']} dropped segments, {gc['orphans_deleted']} orphans, "
                f"{float(gc['bytes_freed']) / 1e6:.1f} MB; {checks}"
            )


def run_dagster_demo(settings: Settings, options: DemoOptions, console: Console | None = None) -> int:
    console = console or Console(width=130)
    started = time.monotonic()
    settings = replace(settings, sync_max_age=min(settings.sync_max_age, DEMO_SYNC_MAX_AGE))
    stack = Stack.open(settings, detach=True)
    service = DagsterService(settings)
    ok = False
    try:
        console.print(
            f"[bold]etcd[/] at {','.join(stack.store.endpoints)}; starting Spark Connect and Dagster ..."
        )
        url = service.start()
        console.print(
            f"[bold]Dagster UI[/]: {url}  (daemon + webserver up after {time.monotonic() - started:.0f}s)"
        )
        _wait(lambda: len(_dagster_nodes(stack)) >= 2, 90, "2 Dagster-hosted DataNodes")
        console.print(f"DataNodes (sensors datanode_1, datanode_2): {_dagster_nodes(stack)}")

        producer = Producer(stack)
        info = create_demo_collection(producer, options.channels, console)
        name = info.name
        manager = ChannelManager(stack.store, settings)
        took = _wait(lambda: _all_watched(manager, info), 90, "every vchannel to be watched")
        console.print(
            f"the DataCoord sensor assigned every vchannel; nodes answered WatchSuccess ({took:.0f}s)"
        )

        deleted, flush_ts, inserted_ts = produce_demo_data(producer, name, options, console)
        console.print(f"produced {options.rows:,} rows and {len(deleted):,} deletes; flush at ts {flush_ts}")
        check_read(
            stack,
            info,
            "a fresh read right after produce (in the log or in segments)",
            options.rows,
            deleted,
            console,
        )
        took = _wait(lambda: producer.flush_state(name, flush_ts), 240, f"the flush at ts {flush_ts}")
        console.print(f"flush state reached {took:.0f}s after the flush call (sensor-driven sync runs)")

        with dg.DagsterInstance.from_config(str(service.home)) as instance:
            # The runs still in flight (a last sync after the flush) finish first.
            _wait(lambda: not _runs_in_flight(instance, info), 120, "the last sync runs")
            checks = latest_checks(instance, list(info.vchannels))
            runs = instance.get_runs(dg.RunsFilter(job_name="sync", tags={CHANNEL_TAG: list(info.vchannels)}))
            failed = [r for r in runs if r.status is dg.DagsterRunStatus.FAILURE]
            catalog = dg.materialize(
                [segment_table],
                instance=instance,
                resources={"vchan": VchanResource.from_settings(settings)},
                run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
            )
        _report_checks(console, info, checks)
        check_binlogs(stack.store, stack.storage, info, options.rows, deleted)
        console.print(_summary(stack, info))
        what = f"a read at ts {inserted_ts} (after the inserts, before the deletes)"
        check_read(stack, info, what, options.rows, [], console, as_of=inserted_ts)
        _lifecycle_assets(console, replace(settings, spark_remote=_spark_remote(service, settings)))
        check_lifecycle(stack, settings, info, options.rows, deleted, console)
        check_index_and_search(stack, info, deleted, console)
        console.print(_summary(stack, info))
        (mat,) = catalog.asset_materializations_for_node("segment_table")
        console.print(
            f"{len(runs)} sync runs ({len(failed)} failed: lease moved during a reassignment); "
            f"segment_table: {mat.metadata['segments'].value} segments at {mat.metadata['path'].value}"
        )
        console.print(
            f"[bold green]demo finished in {time.monotonic() - started:.0f}s[/]: every row is in exactly one "
            "flushed binlog, every delete in a delta log"
        )
        ok = True
        return 0
    finally:
        keep = options.keep and ok
        processes = service_processes(service) + etcd_process(stack)
        if not keep:
            service.stop()
        stack.close(stop_etcd=not keep)
        for line in ending(processes, stopping=not keep):
            console.print(line)


def service_processes(service: DagsterService) -> list[DemoProcess]:
    """The Dagster daemon and webserver and the Spark Connect server `service` runs, as
    its start recorded them (none if it did not get that far)."""
    state = service.recorded() or {}
    pids = [int(p) for p in state.get("pids", [])]  # the daemon's, then the webserver's
    names = ["the Dagster daemon", f"the Dagster webserver, UI {state.get('url')}"]
    processes = [DemoProcess(name, pid) for name, pid in zip(names, pids, strict=False)]
    if state.get("spark_pid"):
        processes.append(
            DemoProcess(f"the Spark Connect server at {state.get('spark_remote')}", int(state["spark_pid"]))
        )
    return processes
