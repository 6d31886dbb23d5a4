"""The `vchan` command.

Every subcommand is a `Command`: its name, a function adding its arguments, and a
function `(args, settings) -> exit code`. Add one with the `@command(...)` decorator
(or append to `COMMANDS`); `main` builds the parser from the list.

Configuration comes from the environment (`Settings.from_env`, see config.py): a bad
value prints the message and exits 2. Without VCHAN_ETCD_ENDPOINTS the embedded etcd
under $VCHAN_HOME is used (started if it is not running). Errors of the system (etcd,
log, storage, bad input) print one line and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import get_args

import numpy as np

from vchan_assets.config import ConfigError, Settings
from vchan_assets.datacoord.collections import DEFAULT_PARTITION, CollectionExistsError, CollectionRegistry
from vchan_assets.datacoord.coordinator import RELOAD_INTERVAL, TICK_INTERVAL
from vchan_assets.deploy.processes import ServiceError
from vchan_assets.meta.embedded import EmbeddedEtcd, EmbeddedEtcdError
from vchan_assets.meta.errors import MetaError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.spark import Engine
from vchan_assets.stack import Stack
from vchan_assets.storage import Storage, StorageError
from vchan_assets.system import System
from vchan_assets.wal.format import LogError
from vchan_assets.wal.producer import ChannelAppend, Producer, generate_rows

log = logging.getLogger("vchan")

Run = Callable[[argparse.Namespace, Settings], int]
Configure = Callable[[argparse.ArgumentParser], None]


class UsageError(ValueError):
    """A command's arguments make no sense together: exit code 1 with the message.
    (Other ValueErrors are bugs and keep their traceback.)"""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Configure
    run: Run


COMMANDS: list[Command] = []


def command(name: str, help: str, configure: Configure | None = None) -> Callable[[Run], Run]:
    """Register a subcommand: `@command("status", "show ...", _status_args)`."""

    def register(run: Run) -> Run:
        COMMANDS.append(Command(name, help, configure or (lambda parser: None), run))
        return run

    return register


# --- shared plumbing --------------------------------------------------------------------


def open_system(settings: Settings) -> Stack:
    """The system as every command opens it (`Stack.open`): VCHAN_ETCD_ENDPOINTS, or the
    embedded etcd (reused if running; one started here dies with the command)."""
    return Stack.open(settings)


def connect(settings: Settings) -> MetaStore:
    return open_system(settings).store


@contextlib.contextmanager
def opened(settings: Settings) -> Iterator[Stack]:
    """`open_system` for one command: its etcd client is closed when the command ends."""
    stack = open_system(settings)
    try:
        yield stack
    finally:
        stack.store.close()


@contextlib.contextmanager
def opened_collection(settings: Settings, name: str) -> Iterator[tuple[Stack, CollectionInfo]]:
    """`opened`, for a command on one collection: CollectionNotFoundError before anything."""
    with opened(settings) as stack:
        yield stack, CollectionRegistry(stack.store).get_by_name(name)


@contextlib.contextmanager
def open_producer(settings: Settings) -> Iterator[Producer]:
    with opened(settings) as stack:
        producer = Producer(stack)
        try:
            yield producer
        finally:
            producer.close()  # its append locks go at once, not when their lease expires


def _engine_arg(parser: argparse.ArgumentParser, tasks: str) -> None:
    parser.add_argument(
        "--engine", choices=get_args(Engine), default="spark", help=f"where {tasks} run (default spark)"
    )


def _names(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _scalars(raw: str) -> dict[str, str]:
    out = {}
    for item in _names(raw):
        name, sep, dtype = item.partition(":")
        if not sep:
            raise UsageError(
                f"--scalars item {item!r}: expected name:type (int64, float, double, string, bool)"
            )
        out[name.strip()] = dtype.strip()
    return out


# --- create-collection ------------------------------------------------------------------


def _create_collection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", "--name", dest="collection", required=True, help="collection name")
    parser.add_argument("--dim", type=int, default=128, help="dimension of the vector field (default 128)")
    parser.add_argument("--vector", default="vector", help="name of the vector field (default: vector)")
    parser.add_argument("--pk", default="id", help="name of the int64 primary key (default: id)")
    parser.add_argument(
        "--scalars",
        default="age:int64,label:string",
        help="scalar fields as name:type,... (types: int64 float double string bool)",
    )
    parser.add_argument("--shards", type=int, default=2, help="number of vchannels (default 2)")
    parser.add_argument("--partitions", default="", help="extra partitions besides _default: a,b,...")
    parser.add_argument("--if-not-exists", action="store_true", help="succeed if the collection exists")


@command("create-collection", "create a collection and its vchannels", _create_collection_args)
def create_collection(args: argparse.Namespace, settings: Settings) -> int:
    try:
        schema = CollectionSchema.build(args.pk, {args.vector: args.dim}, _scalars(args.scalars))
    except ValueError as exc:  # a bad type name, field name or dimension
        raise UsageError(f"invalid schema: {exc}") from None
    with open_producer(settings) as producer:
        try:
            info = producer.create_collection(
                args.collection, schema, _names(args.partitions), num_channels=args.shards
            )
        except CollectionExistsError:
            if not args.if_not_exists:
                raise
            info = producer.collection(args.collection)
            print(f"collection {info.name} exists (id {info.id})")
            return 0
    print(f"created collection {info.name} (id {info.id})")
    print(f"  fields: {', '.join(f'{f.name}:{f.dtype.value}' for f in info.schema.fields)}")
    print(f"  partitions: {', '.join(info.partition_names)}")
    print(f"  vchannels: {', '.join(info.vchannels)}")
    return 0


# --- produce ----------------------------------------------------------------------------


def _positive(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw} is not a positive integer")
    return value


def _produce_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection to insert into")
    parser.add_argument("--rows", type=_positive, required=True, help="rows to insert")
    parser.add_argument(
        "--batch", type=_positive, default=10_000, help="rows per insert call (default 10000)"
    )
    parser.add_argument(
        "--deletes", type=int, default=0, help="delete this many of the inserted pks at the end"
    )
    parser.add_argument("--partition", default=DEFAULT_PARTITION, help="partition to insert into")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the generated data")
    parser.add_argument(
        "--start-pk",
        type=int,
        default=None,
        help="first primary key (default: fresh IDs, unique across runs)",
    )
    parser.add_argument("--flush", action="store_true", help="seal the collection's segments at the end")


@command("produce", "insert generated rows (and deletes) into a collection's log", _produce_args)
def produce(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if args.deletes < 0 or args.deletes > args.rows:
        raise UsageError(f"--deletes must be between 0 and --rows ({args.rows})")
    with open_producer(settings) as producer:
        info = producer.collection(args.collection)
        start_pk = producer.ids.alloc(args.rows) if args.start_pk is None else args.start_pk
        appended: dict[str, ChannelAppend] = {}
        segments: set[int] = set()
        started = time.monotonic()
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        with progress:
            task = progress.add_task(f"insert {info.name}", total=args.rows, rate="")
            done = 0
            while done < args.rows:
                n = min(args.batch, args.rows - done)
                rows = generate_rows(info.schema, n, start_pk + done, seed=args.seed + done)
                for vchannel, result in producer.insert(info.name, rows, args.partition).items():
                    appended[vchannel] = result
                    segments.update(s for s, _ in result.segments)
                done += n
                rate = done / max(time.monotonic() - started, 1e-9)
                progress.update(task, completed=done, rate=f"{rate:,.0f} rows/s")
            insert_seconds = time.monotonic() - started
            if args.deletes:
                rng = np.random.default_rng(args.seed)
                pks = start_pk + rng.choice(args.rows, size=args.deletes, replace=False)
                task = progress.add_task("delete", total=args.deletes, rate="")
                for i in range(0, args.deletes, args.batch):
                    chunk = pks[i : i + args.batch]
                    appended.update(producer.delete(info.name, chunk))
                    progress.update(task, advance=len(chunk))
        flush_ts = producer.flush(info.name) if args.flush else None
    print(
        f"inserted {args.rows} rows (pk {start_pk}..{start_pk + args.rows - 1}) into {info.name} "
        f"in {insert_seconds:.2f}s ({args.rows / max(insert_seconds, 1e-9):,.0f} rows/s), "
        f"{len(segments)} segments; deleted {args.deletes}"
    )
    for vchannel in info.vchannels:
        if vchannel in appended:
            print(
                f"  {vchannel}: head offset {appended[vchannel].last_offset} ts {appended[vchannel].timestamp}"
            )
    if flush_ts is not None:
        print(f"flush_ts {flush_ts}")
    return 0


# --- sync -------------------------------------------------------------------------------

EXIT_LEASE_LOST = 3


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
    _engine_arg(parser, "tasks")


@command("sync", "persist a collection's vchannels from their checkpoints into binlogs", _sync_args)
def sync(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.datacoord.leases import current_lease, grant_channel_lease
    from vchan_assets.datanode.sync import SyncTask
    from vchan_assets.meta.allocator import IdAllocator
    from vchan_assets.meta.errors import LeaseLostError

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
            if result.skipped:
                print(f"{vchannel}: nothing to sync ({result.skipped})")
            else:
                print(
                    f"{vchannel}: ({result.start.offset}, {result.end.offset}] {result.rows} rows, "
                    f"{result.deletes} deletes, {result.files} files, {result.bytes / 1e6:.1f} MB, "
                    f"{len(result.flushed_segments)} segments flushed in {result.seconds:.2f}s "
                    f"({result.written_by}; {result.phases})"
                )
    return 0


# --- segment lifecycle ------------------------------------------------------------------


def _compact_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection name")
    parser.add_argument(
        "--type",
        choices=("sort", "l0", "mix"),
        default="mix",
        help="sort by pk, move L0 deletes into the segments they hit (l0), or merge (mix)",
    )
    parser.add_argument("--wait", action="store_true", help="run the plans here and wait for each to finish")
    _engine_arg(parser, "tasks")


@command("compact", "plan (and with --wait run) a manual compaction of a collection", _compact_args)
def compact(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
    from vchan_assets.lifecycle.plans import CompactionType, PlanState

    with opened_collection(settings, args.collection) as (stack, info):
        kind = CompactionType(args.type)
        plans = CompactionTrigger(stack).trigger(info, kind, manual=True)
        for p in plans:
            print(f"plan {p.plan_id}: {p.type} of segments {list(p.input_ids)} -> {p.state}", flush=True)
        if not plans:
            print(f"{args.collection}: nothing to compact ({kind})")
        if not args.wait or not plans:
            return 0
        executor = CompactionExecutor(stack, engine=args.engine)
        outcomes = executor.run_pending([p.plan_id for p in plans])
        for i, o in enumerate(outcomes, 1):
            detail = f"-> segments {list(o.outputs)}" if o.state is PlanState.COMPLETED else o.reason
            print(f"[{i}/{len(outcomes)}] plan {o.plan_id}: {o.state} {detail}", flush=True)
        return 0 if all(o.state is PlanState.COMPLETED for o in outcomes) else 1


def _gc_args(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--once", action="store_true", help="one pass now (the default)")
    what.add_argument("--pause", type=float, metavar="S", help="pause garbage collection for S seconds")
    what.add_argument("--resume", action="store_true", help="resume a paused garbage collection")
    parser.add_argument(
        "--dry-run", action="store_true", help="list what a pass would delete, delete nothing"
    )


@command("gc", "garbage-collect orphan binlogs, dropped segments and old log files", _gc_args)
def gc(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.lifecycle.gc import GarbageCollector

    with opened(settings) as stack:
        collector = GarbageCollector(stack)
        if args.pause is not None:
            print(f"garbage collection paused for {args.pause:g}s")
            collector.pause(args.pause)
            return 0
        if args.resume:
            collector.resume()
            print("garbage collection resumed")
            return 0
        report = collector.run(dry_run=args.dry_run)
        if report.paused_until:
            print(f"garbage collection is paused ({report.paused_until - time.time():.0f}s left)")
            return 0
        verb = "would delete" if args.dry_run else "deleted"
        for key in [*report.orphans, *report.segment_files, *report.wal_files]:
            print(f"{verb} {key}")
        print(
            f"gc: {verb} {len(report.orphans)} orphans, {len(report.dropped_segments)} dropped segments "
            f"({len(report.segment_files)} files), {len(report.wal_files)} log files, "
            f"{report.bytes / 1e6:.1f} MB"
        )
        return 0


# --- bulk import ------------------------------------------------------------------------


def _import_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", metavar="FILE_OR_DIR", help="input files or directories")
    parser.add_argument("--collection", help="collection to import into")
    parser.add_argument("--partition", default=DEFAULT_PARTITION, help="partition (default: _default)")
    parser.add_argument(
        "--format", choices=("parquet", "json", "csv"), default="parquet", help="input format"
    )
    parser.add_argument("--job-id", type=int, help="job id (submitting the same id again imports once)")
    parser.add_argument(
        "--upsert", action="store_true", help="replace the rows whose pk is already in the collection"
    )
    parser.add_argument(
        "--drop-unknown-columns", action="store_true", help="ignore columns the schema does not have"
    )
    parser.add_argument("--wait", action="store_true", help="run the job here and show its progress")
    _engine_arg(parser, "import tasks")
    parser.add_argument("--status", type=int, metavar="JOB", help="show one job")
    parser.add_argument("--list", action="store_true", help="list every import job")


@command("import", "bulk-import Parquet, JSON-lines or CSV files into flushed segments", _import_args)
def import_files(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets import imports
    from vchan_assets.imports.progress import ProgressPrinter, describe

    try:
        with opened(settings) as stack:
            store = stack.store
            if args.list:
                for job in imports.jobs(store=store, settings=settings):
                    print(describe(job))
                return 0
            if args.status is not None:
                job = imports.status(args.status, store=store, settings=settings)
                print(describe(job, verbose=True))
                return 0 if job.state is not imports.ImportState.FAILED else 1
            if not args.collection or not args.files:
                raise UsageError("give --collection and at least one FILE_OR_DIR (or --status JOB / --list)")
            job_id = imports.submit(
                args.collection, args.files, partition=args.partition, format=args.format, job_id=args.job_id,
                upsert=args.upsert,
                drop_unknown_columns=args.drop_unknown_columns, store=store, settings=settings,
            )  # fmt: skip
            print(f"import job {job_id} submitted", flush=True)
            if not args.wait:
                return 0
            with ProgressPrinter() as progress:
                job = imports.run(
                    job_id, engine=args.engine, on_progress=progress, store=store, settings=settings
                )
            print(describe(job, verbose=True))
            return 0 if job.state is imports.ImportState.COMPLETED else 1
    except imports.ImportInputError as exc:  # a path that does not exist
        raise UsageError(str(exc)) from None


# --- demo, up, down ---------------------------------------------------------------------


def _demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=_positive, default=200_000, help="rows to produce (default 200000)")
    parser.add_argument("--deletes", type=int, default=2_000, help="primary keys to delete (default 2000)")
    parser.add_argument("--channels", type=_positive, default=4, help="vchannels (default 4)")
    parser.add_argument("--keep", action="store_true", help="leave the embedded stack running")
    parser.add_argument(
        "--direct", action="store_true", help="sync in this process, without Dagster (the pre-Dagster demo)"
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run the direct demo on a cluster started here and torn down after: "
        "3-member etcd, Spark master + 2 workers, S3 server",
    )


@command("demo", "run the whole pipeline on generated data on the embedded stack", _demo_args)
def demo(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.demo import DemoCheckError, DemoOptions, run_demo

    options = DemoOptions(rows=args.rows, deletes=args.deletes, channels=args.channels, keep=args.keep)
    try:
        if args.cluster:
            from vchan_assets.deploy.cluster_demo import run_cluster_demo

            return run_cluster_demo(settings, options)
        if not args.direct:
            from vchan_assets.deploy.dagster_demo import run_dagster_demo

            return run_dagster_demo(settings, options)
        return run_demo(settings, options)
    except DemoCheckError as exc:  # what was read back is not what was produced
        print(f"vchan demo: check failed: {exc}", file=sys.stderr)
        return 1


def _up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--supervise",
        action="store_true",
        help="stay in the foreground and start again any Dagster service that dies (backoff on failure)",
    )


@command(
    "up",
    "start the embedded stack (etcd, Spark Connect, Dagster webserver + daemon) in the background",
    _up_args,
)
def up(args: argparse.Namespace, settings: Settings) -> int:
    stack = Stack.open(settings, detach=True)
    try:
        for key, value in stack.health().items():
            print(f"{key:16s} {value}")
    finally:
        stack.close(stop_etcd=False)
    # The Dagster deployment: Spark Connect server, dagster-daemon, dagster-webserver.
    from vchan_assets.deploy.service import DagsterService

    print("starting Spark Connect, dagster-daemon and dagster-webserver ...", flush=True)
    service = DagsterService(settings)
    url = service.start()
    print(f"{'dagster_ui':16s} {url}")
    if args.supervise:
        from vchan_assets.deploy.supervisor import Supervisor

        print("supervising: a service that dies is started again (Ctrl-C to stop supervising)", flush=True)
        Supervisor(service.missing, service.start).run(_stop_on_signals())
    return 0


@command("down", "stop the embedded stack started by `vchan up` or `vchan demo --keep`")
def down(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.deploy.service import DagsterService

    dagster_stopped = DagsterService(settings).stop()
    print(
        "dagster webserver, daemon and Spark Connect stopped"
        if dagster_stopped
        else "dagster was not running"
    )
    stopped = EmbeddedEtcd(settings.etcd_dir).stop_recorded()
    print("embedded etcd stopped" if stopped else "embedded etcd was not running")
    return 0


# --- status, metrics --------------------------------------------------------------------


def _status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    parser.add_argument(
        "--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted",
    )  # fmt: skip
    parser.add_argument("--no-orphans", action="store_true", help="skip listing storage for orphan binlogs")


@command("status", "show nodes, channels, checkpoints and lag, segments and warnings", _status_args)
def status(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from rich.console import Console
    from rich.live import Live

    from vchan_assets.catalog import Catalog
    from vchan_assets.status import collect_status, render_status

    with Catalog.open(settings) as catalog:
        if args.json and args.watch is None:
            print(json.dumps(collect_status(catalog, orphans=not args.no_orphans), indent=2))
            return 0
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)  # piped: do not squeeze the tables into 80 columns
        if args.watch is None:
            console.print(render_status(collect_status(catalog, orphans=not args.no_orphans)))
            return 0
        if args.json:  # one JSON document per line, for `| jq` or a log shipper (`| head`: see main)
            while True:
                print(json.dumps(collect_status(catalog, orphans=not args.no_orphans)), flush=True)
                time.sleep(args.watch)
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(render_status(collect_status(catalog, orphans=not args.no_orphans)), refresh=True)
                time.sleep(args.watch)


def _metrics_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--serve", type=int, metavar="PORT", help="serve GET /metrics on 127.0.0.1:PORT (0: a free port)"
    )


@command("metrics", "print metrics in the Prometheus text format, or serve them over HTTP", _metrics_args)
def metrics(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.catalog import Catalog
    from vchan_assets.metrics import MetricsServer, exposition

    with Catalog.open(settings) as catalog:
        if args.serve is None:
            sys.stdout.write(exposition(catalog))
            return 0
        server = MetricsServer(catalog, args.serve)
        print(f"serving metrics on http://127.0.0.1:{server.port}/metrics", flush=True)
        try:
            server.serve_forever()
        finally:
            server.shutdown()
    return 0


# --- datanode, datacoord (long-running roles) -------------------------------------------

EXIT_SESSION_LOST = 4


def _stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: long-running roles shut down cleanly on it."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def _datanode_args(parser: argparse.ArgumentParser) -> None:
    _engine_arg(parser, "sync tasks")
    parser.add_argument(
        "--poll", type=float, default=1.0, help="seconds between sync-policy checks per channel (default 1)"
    )
    parser.add_argument("--address", default="", help="address recorded in the node's session")


@command("datanode", "run a DataNode: session, channel watch, syncing (until SIGTERM)", _datanode_args)
def datanode(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.datanode.node import DataNode

    logging.getLogger().setLevel(logging.INFO)
    stop = _stop_on_signals()
    system = open_system(settings)
    node = DataNode(system, engine=args.engine, poll_interval=args.poll, address=args.address)
    node.on_session_lost = stop.set
    try:
        node.start()
        print(f"datanode {node.node_id} started", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        node.stop(final_sync=not node.session_lost.is_set())
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
    _engine_arg(parser, "compaction and import tasks")


def _run_lifecycle(
    settings: Settings, writer: Callable[[], MetaStore | None], stop: threading.Event, engine: str
) -> None:
    """The segment lifecycle beside the coordinator while this DataCoord is the active one
    (`writer()`: the store fenced by its term, None while standing by): newly flushed
    segments sorted every VCHAN_SORT_POLL_INTERVAL (the stats task after flush), the whole
    step (plans, L0/mix compaction, GC) every VCHAN_LIFECYCLE_INTERVAL."""
    from vchan_assets.lifecycle.step import lifecycle_step, sort_step

    storage = Storage.from_settings(settings)
    next_step = time.monotonic() + settings.lifecycle_interval
    while not stop.wait(min(settings.sort_poll_interval, settings.lifecycle_interval)):
        store = writer()
        if store is None:
            continue
        system = System(settings, store, storage)  # its writes fenced by this DataCoord's term
        try:
            if time.monotonic() >= next_step:
                next_step = time.monotonic() + settings.lifecycle_interval
                report = lifecycle_step(system, engine=engine)  # type: ignore[arg-type]
                log.info("lifecycle step: %d planned, %d run", len(report.planned), len(report.outcomes))
            else:
                sorted_now = sort_step(system, engine=engine)  # type: ignore[arg-type]
                if sorted_now:
                    log.info("sorted %d newly flushed segments", len(sorted_now))
        except (MetaError, StorageError, LogError) as exc:
            log.warning("lifecycle step failed (%s); trying again", exc)


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

    logging.getLogger().setLevel(logging.INFO)
    stop = _stop_on_signals()
    store = connect(settings)
    try:
        coord = DataCoordinator(settings, store, interval=args.interval, reload_interval=args.reload_interval)
        runner = threading.Thread(target=coord.run, args=(stop,), name="datacoord", daemon=True)
        runner.start()
        lifecycle = threading.Thread(
            target=_run_lifecycle, args=(settings, lambda: coord.writer, stop, args.engine), daemon=True
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
        store.close()
    print(f"datacoord {coord.server_id} stopped", flush=True)
    return 0


# --- entry point ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vchan", description="Milvus-style vchannels to binlogs on etcd, Spark and Dagster."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", required=True)
    for cmd in COMMANDS:
        child = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(child)
        child.set_defaults(command=cmd)
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"vchan: configuration error: {exc}", file=sys.stderr)
        return 2
    cmd: Command = args.command
    try:
        return cmd.run(args, settings)
    except BrokenPipeError:  # the reader went away (`vchan status --json | head`): done
        _silence_stdout()
        return 0
    except (MetaError, LogError, StorageError, EmbeddedEtcdError, ServiceError, UsageError) as exc:
        print(f"vchan {cmd.name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"vchan {cmd.name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
