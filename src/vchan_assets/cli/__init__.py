"""The `vchan` command.

Owns the command line: one module per command group, each registering its commands
with `@command(...)` (base.py: `Command`, `COMMANDS` and what the groups share):
- `collections`: create-collection, produce.
- `nodes`: sync, and the long-running roles datanode and datacoord.
- `lifecycle`: compact, gc, quarantine, tasks.
- `imports`: import.
- `indexes`: create-index, drop-index, describe-index, search.
- `services`: demo, up, down, status, metrics.
Here only the wiring: `main` builds the parser from `COMMANDS` and runs one command.

Configuration comes from the environment (`Settings.from_env`, see config.py): a bad
value prints the message and exits 2. Without VCHAN_ETCD_ENDPOINTS the embedded etcd
under $VCHAN_HOME is used (started if it is not running). Errors of the system (etcd,
log, storage, bad input) print one line and exit 1.

May import: anything in vchan_assets (it is the top layer). The command modules import
what only their commands need inside those commands, so that `vchan --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# The command groups: importing them registers their commands in COMMANDS.
from vchan_assets.cli import collections, imports, indexes, lifecycle, nodes, services  # noqa: F401
from vchan_assets.cli.base import COMMANDS, Command, UsageError
from vchan_assets.config import ConfigError, Settings
from vchan_assets.deploy.processes import ServiceError
from vchan_assets.meta.embedded import EmbeddedEtcdError
from vchan_assets.meta.errors import MetaError
from vchan_assets.storage import StorageError
from vchan_assets.wal.format import LogError

# The order of `vchan --help` (the import order of the groups cannot give it): the data
# path, the stack's services, the long-running roles. A command not named here comes
# after them, in the order it registered.
_HELP_ORDER = (
    "create-collection", "produce", "sync", "compact", "gc", "import",
    "create-index", "describe-index", "drop-index", "search", "tasks",
    "demo", "up", "down", "status", "metrics",
    "datanode", "datacoord",
)  # fmt: skip
COMMANDS.sort(key=lambda cmd: _HELP_ORDER.index(cmd.name) if cmd.name in _HELP_ORDER else len(_HELP_ORDER))


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
