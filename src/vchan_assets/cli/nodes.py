"""The roles of the nodes: `vchan sync` (one sync, here), and the long-running
`vchan datanode` and `vchan datacoord` (until SIGTERM).

`vchan sync` over several channels syncs every one it can: a channel whose log is damaged
is named on stderr and skipped, and the command exits with EXIT_DAMAGED (5) naming them
all at the end."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable

from vchan_assets.cli.base import (
    EXIT_DAMAGED,
    EXIT_LEASE_LOST,
    EXIT_SESSION_LOST,
    command,
    connect,
    engine_arg,
    open_system,
    opened_collection,
    stop_on_signals,
)
from vchan_assets.config import Settings
from vchan_assets.datacoord.coordinator import RELOAD_INTERVAL, TICK_INTERVAL
from vchan_assets.meta.errors import MetaError
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage, StorageError
from vchan_assets.system import System
from vchan_assets.wal.format import LogError

log = logging.getLogger("vchan")

# --- sync -------------------------------------------------------------------------------


def _sync_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection name")
    parser.add_argument("--channel", help="one vchannel (default: every vchannel of the collection)")
    lease = parser.add_mutually_exclusive_group(required=True)
    lease.add_argument("--lease-id", type=int, help="sync under this channel lease (it must be current)")
    lease.add_argument(
        "--take-lease",
        action="store_true",
        help="grant a new lease to this command first (fences off the channel's current writer)",
    )
    engine_arg(parser, "tasks")


@command("sync", "persist a collection's vchannels from their checkpoints into binlogs", _sync_args)
def sync(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.datacoord.leases import current_lease, grant_channel_lease
    from vchan_assets.datanode.sync import SyncTask
    from vchan_assets.meta.allocator import IdAllocator
    from vchan_assets.meta.errors import LeaseLostError

    damaged: dict[str, LogError] = {}
    with opened_collection(settings, args.collection) as (stack, info):
        store = stack.store
        channels = [args.channel] if args.channel else list(info.vchannels)
        for vchannel in channels:
            try:
                if args.take_lease:
                    lease = grant_channel_lease(store, IdAllocator(store), vchannel, node_id=0)
                else:  # LeaseLostError before anything is done if the lease is not current
                    lease = current_lease(store, vchannel, args.lease_id)
                result = SyncTask(stack, info, vchannel, lease, engine=args.engine).run()
            except LeaseLostError as exc:
                print(f"vchan sync: stopped {vchannel}: {exc}", file=sys.stderr)
                return EXIT_LEASE_LOST
            except LogError as exc:  # this channel's log is damaged: the others go on
                print(f"vchan sync: {vchannel} not synced: {exc}", file=sys.stderr)
                damaged[vchannel] = exc
                continue
            if result.skipped:
                print(f"{vchannel}: nothing to sync ({result.skipped})")
            else:
                print(
                    f"{vchannel}: ({result.start.offset}, {result.end.offset}] {result.rows} rows, "
                    f"{result.deletes} deletes, {result.files} files, {result.bytes / 1e6:.1f} MB, "
                    f"{len(result.flushed_segments)} segments flushed in {result.seconds:.2f}s "
                    f"({result.written_by}; {result.phases})"
                )
    if damaged:
        print(
            f"vchan sync: damaged, not synced: {', '.join(damaged)} "
            "(see docs/protection.md: `vchan quarantine --file PATH` gets a channel past a damaged log file)",
            file=sys.stderr,
        )
        return EXIT_DAMAGED
    return 0


# --- datanode, datacoord (long-running roles) -------------------------------------------


def _datanode_args(parser: argparse.ArgumentParser) -> None:
    engine_arg(parser, "sync tasks")
    parser.add_argument(
        "--poll", type=float, default=1.0, help="seconds between sync-policy checks per channel (default 1)"
    )
    parser.add_argument("--address", default="", help="address recorded in the node's session")


@command("datanode", "run a DataNode: session, channel watch, syncing (until SIGTERM)", _datanode_args)
def datanode(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.datanode.node import DataNode

    logging.getLogger().setLevel(logging.INFO)
    stop = stop_on_signals()
    system = open_system(settings)
    node = DataNode(system, engine=args.engine, poll_interval=args.poll, address=args.address)
    node.on_session_lost = stop.set
    try:
        node.start()
        print(f"datanode {node.node_id} started", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        # Graceful stop: STOPPING first (the coordinator moves the channels at once, under
        # new leases), the sync in flight finishes or is refused, then the session ends.
        node.stop(final_sync=False)
        system.store.close()
    if node.session_lost.is_set():
        reason = node.session.expiry_reason if node.session else ""
        print(f"vchan datanode: node {node.node_id} lost its session ({reason}); exiting", file=sys.stderr)
        return EXIT_SESSION_LOST
    print(f"datanode {node.node_id} stopped", flush=True)
    return 0


def _datacoord_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval", type=float, default=TICK_INTERVAL, help="seconds between reconcile steps"
    )
    parser.add_argument(
        "--reload-interval", type=float, default=RELOAD_INTERVAL, help="seconds between segment-meta reloads"
    )
    engine_arg(parser, "compaction, sort, index build and import tasks")


def _run_imports(
    settings: Settings, writer: Callable[[], MetaStore | None], stop: threading.Event, engine: str
) -> None:
    """Bulk import beside the coordinator: start Pending jobs and take over stuck ones every
    VCHAN_IMPORT_INTERVAL while this DataCoord is the active one (writes fenced by its term)."""
    from vchan_assets.imports.step import import_step

    storage = Storage.from_settings(settings)
    while not stop.wait(settings.import_interval):
        store = writer()
        if store is None:
            continue
        try:
            report = import_step(System(settings, store, storage), engine=engine)  # type: ignore[arg-type]
            if report.started or report.resumed:
                log.info("import step: completed %s, failed %s", report.completed, report.failed)
        except (MetaError, StorageError) as exc:
            log.warning("import step failed (%s); next one in %gs", exc, settings.import_interval)


@command("datacoord", "run a DataCoord (active-standby by election) until SIGTERM", _datacoord_args)
def datacoord(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.datacoord.coordinator import DataCoordinator
    from vchan_assets.datacoord.tasks import TaskScheduler
    from vchan_assets.indexes.gc import collect_indexes
    from vchan_assets.indexes.tasks import IndexTasks
    from vchan_assets.lifecycle.handoff import run_lifecycle
    from vchan_assets.lifecycle.sort_tasks import SortTasks
    from vchan_assets.meta.segment_cache import SegmentCache

    logging.getLogger().setLevel(logging.INFO)
    stop = stop_on_signals()
    store = connect(settings)
    # Segment meta in memory (Milvus' meta.go), warmed before this process campaigns: a
    # standby that takes over starts with it loaded. Until it is, listings read etcd.
    cache = SegmentCache(store).start()
    if not cache.wait_loaded(settings.etcd_timeout * 2):
        log.warning("the segment cache is not loaded yet: segment listings read etcd until it is")
    store.segment_cache = cache
    try:
        # One task scheduler for the tasks after flush: sorts first, then index builds. A
        # stopping DataCoord gives up its batches in flight (the next one runs them) and
        # exits without waiting for them.
        tasks = TaskScheduler([SortTasks(), IndexTasks()], settings)
        coord = DataCoordinator(
            settings,
            store,
            interval=args.interval,
            reload_interval=args.reload_interval,
            on_stopping=[lambda writer: tasks.abandon(writer, "abandoned: the DataCoord running it stopped")],
        )
        runner = threading.Thread(target=coord.run, args=(stop,), name="datacoord", daemon=True)
        runner.start()
        lifecycle = threading.Thread(
            target=run_lifecycle,
            args=(settings, lambda: coord.writer, stop, tasks, args.engine, [collect_indexes]),
            daemon=True,
        )
        lifecycle.start()
        importer = threading.Thread(
            target=_run_imports, args=(settings, lambda: coord.writer, stop, args.engine), daemon=True
        )
        importer.start()
        print(f"datacoord {coord.server_id} started", flush=True)
        while not stop.wait(0.5) and runner.is_alive():
            pass
        stop.set()
        runner.join(settings.etcd_timeout * 2 + 5)
    finally:
        cache.stop()
        store.close()
    print(f"datacoord {coord.server_id} stopped", flush=True)
    if tasks.abandoned_running:
        # A build given up by the stop still runs in faiss's native threads, which the
        # interpreter's exit would abort under ("terminate called without an active
        # exception"): leave at once, everything this process owed etcd is written.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(0)
    return 0
