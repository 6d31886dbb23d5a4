"""One vchannel's work on a DataNode (the Python counterpart of Milvus' flowgraph):
a thread that syncs the channel whenever a sync policy fires.

As in Milvus: one flowgraph per vchannel; a lost lease closes that channel's work
without crashing the node (the lease design of Milvus' "DataNode removes its dependency
on DataCoord"); release stops it after an optional final sync of
what the log already holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vchan_assets.datacoord.watchers import NotWatcherError, lease_for_watcher
from vchan_assets.datanode import policies
from vchan_assets.datanode.channel_state import read_channel_state
from vchan_assets.datanode.policies import ChannelBacklog, sync_reasons
from vchan_assets.datanode.sync import SyncResult, SyncTask
from vchan_assets.meta.errors import LeaseLostError, MetaUnavailableError, SyncSupersededError
from vchan_assets.model import ChannelLease, CollectionInfo
from vchan_assets.spark import Engine
from vchan_assets.system import System
from vchan_assets.wal.reader import WalReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeContext:
    """What the per-event functions need: a DataNode process passes its own; a Dagster
    sensor or run builds one from its resources."""

    system: System
    node_id: int
    engine: Engine = "local"
    poll_interval: float = 1.0


def channel_backlog(ctx: NodeContext, collection: CollectionInfo, vchannel: str) -> ChannelBacklog:
    """The channel's state as the sync policies see it."""
    return policies.channel_backlog(
        read_channel_state(ctx.system.store, WalReader(ctx.system.storage, vchannel, collection))
    )


def resolve_lease(ctx: NodeContext, vchannel: str, lease: ChannelLease | None) -> ChannelLease:
    """The lease to commit under: the watch info's, or (no lease id: a watch info from an
    older coordinator) one DataCoord hands out after checking this node is the watcher."""
    if lease is not None:
        return lease
    try:
        return lease_for_watcher(ctx.system.store, vchannel, ctx.node_id)
    except NotWatcherError as exc:
        # Same consequence as a lost lease: this node must not write the channel.
        raise LeaseLostError(vchannel, -1, None) from exc


def sync_once(
    ctx: NodeContext,
    collection: CollectionInfo,
    vchannel: str,
    lease: ChannelLease | None,
    force: bool = False,
) -> SyncResult | None:
    """Sync `vchannel` once if a sync policy fires (or `force`); None if none fired.

    Raises LeaseLostError (nothing committed) when the lease is gone or, without a lease
    id, when DataCoord says this node is not the channel's watcher."""
    backlog = channel_backlog(ctx, collection, vchannel)
    reasons = sync_reasons(backlog, ctx.system.settings)
    if not reasons and not (force and (backlog.has_unsynced or backlog.sealed_segments)):
        return None
    used = resolve_lease(ctx, vchannel, lease)
    log.info("node %s syncing %s: %s", ctx.node_id, vchannel, "; ".join(reasons) or "forced")
    return SyncTask(ctx.system, collection, vchannel, used, engine=ctx.engine).run()


class ChannelWorker:
    """Syncs one vchannel in a thread until stopped or its lease is lost.

    `on_stopped(vchannel, reason)` is called from the worker thread when it stops on its
    own (lease lost); `stop()` does not call it."""

    def __init__(
        self,
        ctx: NodeContext,
        collection: CollectionInfo,
        vchannel: str,
        lease: ChannelLease | None,
        on_stopped: Callable[[str, str], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.collection = collection
        self.vchannel = vchannel
        self.lease = lease
        self.on_stopped = on_stopped
        self.stop_reason = ""
        self._stop = threading.Event()
        self._final_sync = False
        self._thread = threading.Thread(target=self._run, name=f"channel {vchannel}", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> ChannelWorker:
        self._thread.start()
        return self

    def stop(self, final_sync: bool = False, timeout: float | None = None, reason: str = "stopped") -> None:
        """Stop the thread; with `final_sync`, first sync what the log already holds."""
        self._final_sync = final_sync
        self.stop_reason = self.stop_reason or reason
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._step(force=False):
                return
            self._stop.wait(self.ctx.poll_interval)
        if self._final_sync:
            self._step(force=True)

    def _step(self, force: bool) -> bool:
        """One policy check and maybe a sync; False when the channel's work must end."""
        try:
            sync_once(self.ctx, self.collection, self.vchannel, self.lease, force=force)
        except LeaseLostError as exc:
            self.stop_reason = f"lease lost: {exc}"
            log.error("node %s stops channel %s: %s", self.ctx.node_id, self.vchannel, exc)
            self._stop.set()
            if self.on_stopped is not None:
                self.on_stopped(self.vchannel, self.stop_reason)
            return False
        except MetaUnavailableError as exc:
            log.warning("node %s: sync of %s failed, retrying: %s", self.ctx.node_id, self.vchannel, exc)
            return True
        except SyncSupersededError as exc:  # a sync outside this worker ran meanwhile (`vchan sync`)
            log.warning("node %s: %s", self.ctx.node_id, exc)
            return True
        except Exception:
            # A bad log file or any bug: keep the node up, log it, retry at the next poll.
            log.exception("node %s: sync of %s failed", self.ctx.node_id, self.vchannel)
        return True
