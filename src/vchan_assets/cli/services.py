"""The stack and what it shows: `vchan demo`, `vchan up`, `vchan down`, `vchan status`
and `vchan metrics`."""

from __future__ import annotations

import argparse
import sys
import time

from vchan_assets.cli.base import UsageError, _positive, command, stop_on_signals
from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.stack import Stack

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
        "3-member etcd, Spark master + 2 workers, S3 server, PostgreSQL (the Dagster instance)",
    )


@command("demo", "run the whole pipeline on generated data on the embedded stack", _demo_args)
def demo(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.demo.direct import DemoCheckError, DemoOptions, run_demo

    options = DemoOptions(rows=args.rows, deletes=args.deletes, channels=args.channels, keep=args.keep)
    try:
        if args.cluster:
            from vchan_assets.demo.cluster import run_cluster_demo

            return run_cluster_demo(settings, options)
        if not args.direct:
            from vchan_assets.demo.via_dagster import run_dagster_demo

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
        Supervisor(service.missing, service.start).run(stop_on_signals())
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
    parser.add_argument(
        "--orphans", action="store_true",
        help="list storage and every segment's binlogs for orphan binlogs (files no segment names)",
    )  # fmt: skip
    parser.add_argument("--no-orphans", action="store_true", help="the default (kept for scripts)")
    parser.add_argument(
        "--segments", action="store_true",
        help="read segment meta itself (in pages) and list every segment, instead of the DataCoord's summaries",
    )  # fmt: skip
    parser.add_argument("--collection", metavar="NAME", help="with --segments: only this collection's")
    parser.add_argument("--vchannel", metavar="NAME", help="with --segments: only this vchannel's")


@command("status", "show nodes, channels, checkpoints and lag, segments and warnings", _status_args)
def status(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from rich.console import Console
    from rich.live import Live

    from vchan_assets.catalog import Catalog
    from vchan_assets.status import SegmentDetail, collect_status, render_status

    if (args.collection or args.vchannel) and not args.segments:
        raise UsageError("--collection and --vchannel narrow --segments: add --segments")
    detail = SegmentDetail(args.collection, args.vchannel) if args.segments else None
    with Catalog.open(settings) as catalog:

        def report() -> dict[str, object]:
            return collect_status(catalog, orphans=args.orphans, segments=detail)

        if args.json and args.watch is None:
            print(json.dumps(report(), indent=2))
            return 0
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)  # piped: do not squeeze the tables into 80 columns
        if args.watch is None:
            console.print(render_status(report()))
            return 0
        if args.json:  # one JSON document per line, for `| jq` or a log shipper (`| head`: see main)
            while True:
                print(json.dumps(report()), flush=True)
                time.sleep(args.watch)
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(render_status(report()), refresh=True)
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
