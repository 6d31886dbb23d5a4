"""What every command group of `vchan` shares.

Every subcommand is a `Command`: its name, a function adding its arguments, and a
function `(args, settings) -> exit code`. Add one with the `@command(...)` decorator
(or append to `COMMANDS`); `main` (cli/__init__.py) builds the parser from the list.

Here too: opening the system for one command (`opened`, `opened_collection`,
`open_producer`), the small argument helpers, the exit codes besides 0, 1 and 2, and
the stop event of the long-running roles.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import get_args

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.spark import Engine
from vchan_assets.stack import Stack
from vchan_assets.wal.producer import Producer

Run = Callable[[argparse.Namespace, Settings], int]
Configure = Callable[[argparse.ArgumentParser], None]

EXIT_LEASE_LOST = 3
EXIT_SESSION_LOST = 4
EXIT_DAMAGED = 5  # `vchan sync`: a channel's log is damaged (the others were synced)


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


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: long-running roles shut down cleanly on it."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


# --- argument helpers -------------------------------------------------------------------


def engine_arg(parser: argparse.ArgumentParser, tasks: str) -> None:
    parser.add_argument(
        "--engine", choices=get_args(Engine), default="spark", help=f"where {tasks} run (default spark)"
    )


def names(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def scalars(raw: str) -> dict[str, str]:
    """`--scalars` as name -> type spec: `age:int32,tags:array(varchar(16), 8),note:varchar(64)?`
    (commas inside parentheses belong to the type)."""
    out = {}
    for item in _top_level_items(raw):
        name, sep, spec = item.partition(":")
        if not sep:
            raise UsageError(f"--scalars item {item!r}: expected name:type ({SCALAR_TYPES})")
        out[name.strip()] = spec.strip()
    return out


SCALAR_TYPES = "int8 int16 int32 int64 float double bool varchar(N) string json array(TYPE, N); ? for nullable, =VALUE for a default"


def _top_level_items(raw: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(raw + ","):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(raw[start:i].strip())
            start = i + 1
    return [item for item in items if item]


def _positive(raw: str) -> int:
    # Keeps its underscore although the command modules import it: argparse names the
    # function in its message for a non-integer ("invalid _positive value: 'x'").
    value = int(raw)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw} is not a positive integer")
    return value
