"""`dagster-daemon run` that keeps its code server while that server lives.

Dagster's daemon controller starts the code server of each code location itself and, every
60 seconds, drops it and starts a new one (`RELOAD_WORKSPACE_INTERVAL`, so that a server that
died or code that changed is picked up within a minute). For this deployment that costs twice:

- each new code server imports the definitions and builds their snapshot again (about 5 CPU
  seconds), and the old one lives on until the runs it started (the nodes' sync loops) end;
- the DataCoord sensor keeps the collection's segment meta in its code server's memory
  (`shared_segment_cache`, loaded by a paged walk of etcd, then kept by a watch). A new code
  server every minute walks every segment of etcd again, once a minute.

`vchan up` starts the daemon through `main()` here instead. It replaces the controller's
freshness check. The workspace is reloaded when a code server of the daemon has exited (a
kill -9, an OOM), at the controller's next check (every 5 s) rather than up to a minute
later, and each minute while a code location fails to load, as Dagster does. A live, loaded
code server is kept for the daemon's life; new code is picked up by restarting the
deployment (`vchan down`, `vchan up`). The check reads the registry of Dagster 1.13 (pinned
in pyproject.toml); with a Dagster whose registry is laid out otherwise, the daemon logs a
warning and reloads every minute, as Dagster's own daemon does.
"""

from __future__ import annotations

import logging

from dagster._core.remote_representation.grpc_server_registry import ErrorRegistryEntry, GrpcServerRegistry
from dagster._daemon import controller
from dagster._daemon.cli import main as dagster_daemon_main

log = logging.getLogger(__name__)

_reload_every_interval = controller.DagsterDaemonController.check_workspace_freshness


def code_servers_need_reload(registry: GrpcServerRegistry | None, now: float) -> bool:
    """Whether a code server the daemon started has exited, or a code location failed to
    load at least `RELOAD_WORKSPACE_INTERVAL` ago (Dagster's own retry cadence: a location
    whose code cannot load is not imported again every 5 s). False when the daemon starts no
    code server (a workspace of `grpc_server`s)."""
    if registry is None:
        return False
    with registry._lock:
        entries = list(registry._active_entries.values())
    for entry in entries:
        if isinstance(entry, ErrorRegistryEntry):
            if now - entry.creation_timestamp > controller.RELOAD_WORKSPACE_INTERVAL:
                return True
        elif entry.process.server_process.poll() is not None:
            return True
    return False


def _reload_when_needed(self: controller.DagsterDaemonController, last_workspace_update_time: float) -> float:
    now = controller.get_current_timestamp()
    try:
        needed = code_servers_need_reload(self._grpc_server_registry, now)
    except AttributeError:  # a Dagster whose registry is laid out otherwise: its own check
        log.warning(
            "cannot tell whether the code servers live: reloading them as Dagster does", exc_info=True
        )
        return _reload_every_interval(self, last_workspace_update_time)
    if not needed:
        return now
    # Dagster's own reload, as if its interval had passed: a reload that fails is retried at
    # the next check and raises once the workspace has been stale for Dagster's tolerance.
    stale_since = min(last_workspace_update_time, now - controller.RELOAD_WORKSPACE_INTERVAL - 1)
    return _reload_every_interval(self, stale_since)


def main() -> None:
    """`dagster-daemon` with the freshness check above; the arguments are dagster-daemon's."""
    controller.DagsterDaemonController.check_workspace_freshness = _reload_when_needed  # type: ignore[method-assign]
    dagster_daemon_main()


if __name__ == "__main__":
    main()
