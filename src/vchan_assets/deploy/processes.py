"""Child processes of a loopback deployment: started in their own session, optionally
dying with their parent (PR_SET_PDEATHSIG), their whole process tree found through /proc.

A Spark worker JVM starts executor JVMs, which start Python workers; a "machine" that
dies takes all of them, so stopping and killing act on the tree, not on one pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from vchan_assets.meta.embedded import dying_with_parent, pid_alive


class ServiceError(RuntimeError):
    """A service this machine starts (Spark Connect, a Spark master or worker, the S3
    server, the Dagster daemon or webserver) did not start or does not answer; the message
    names it and its log file. The CLI reports it as an error line, not a traceback."""


def spawn(
    args: list[str], log_path: Path, env: Mapping[str, str] | None = None, detach: bool = False
) -> subprocess.Popen[bytes]:
    """Start `args` with stdout and stderr appended to `log_path`. Unless `detach`, the
    child is SIGKILLed when the calling thread's process exits, so a crashed caller
    leaves no orphan."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args, preexec = (args, None) if detach else dying_with_parent(args)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            preexec_fn=preexec,
            start_new_session=True,  # the caller's Ctrl-C does not reach it first
        )


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll `condition` until it holds; the seconds it took. TimeoutError after `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - started


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    tree = _children()
    found: list[int] = []
    todo = list(tree.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(tree.get(child, []))
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and everything below it at once (a machine that dies); returns the pids."""
    victims = [pid, *descendants(pid)]
    for victim in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    return victims


def stop_tree(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM `pid`, wait for it and its tree to exit, SIGKILL what is left after `timeout`."""
    tree = [pid, *descendants(pid)]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in tree) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    for victim in tree:
        if pid_alive(victim):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
