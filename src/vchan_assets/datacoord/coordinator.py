"""The DataCoord process role: active-standby through an etcd election (seed
`datacoord_server.go`), running the channel manager, the segment manager's seal
policies and the periodic meta reload of the lease MEP.

Everything the active coordinator decides is in etcd, so a standby that wins the
election continues where the dead one stopped (a pending move: the ToRelease/ReleaseSuccess
it finds is finished by `ChannelManager.reconcile`).

For a Dagster sensor: `DataCoordinator.activate()` once, then `tick(now)` per sensor tick;
a long-running process calls `run(stop_event)`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from vchan_assets import __version__
from vchan_assets.config import Settings
from vchan_assets.datacoord.channel_manager import ChannelManager, ReconcileReport
from vchan_assets.datacoord.segment_manager import FlushRecovery, SealedSegment, SegmentManager
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.errors import MetaError
from vchan_assets.meta.session import Election
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import MsgPosition, NodeSession, SessionState

log = logging.getLogger(__name__)


@dataclass
class MetaReloader:
    """Lease MEP, "DataCoord reloads from metastore periodically": channel checkpoints
    first, then segment meta only if its revision moved past the one seen last (the
    open segments live in the channel heads in etcd; what is reloaded here are Growing
    segments on no head, which get sealed)."""

    store: MetaStore
    segments: SegmentManager
    checkpoints: dict[str, MsgPosition] = field(default_factory=dict)
    segment_revision: int = 0
    reloads: int = 0  # metric

    def reload(self) -> bool:
        """Returns whether segment meta was reloaded."""
        found, _ = self.store.list_models(
            self.store.keys.channel_checkpoints(), MsgPosition, skip_malformed=True
        )
        self.checkpoints = {d.kv.key.rsplit("/", 1)[-1]: d.model for d in found}
        snap = self.store.list_prefix(self.store.keys.segments())
        revision = max((kv.mod_revision for kv in snap.items), default=0)
        if revision <= self.segment_revision:
            return False
        self.segments.seal_orphans()
        self.segment_revision = revision
        return True


@dataclass(frozen=True)
class CoordinatorTick:
    channels: ReconcileReport
    sealed: tuple[SealedSegment, ...] = ()
    reloaded: bool = False


class DataCoordinator:
    """One DataCoord contender; the active one (election winner) runs `tick` in a loop."""

    def __init__(
        self,
        settings: Settings,
        store: MetaStore,
        interval: float = 0.5,
        reload_interval: float = 5.0,
        address: str = "",
    ) -> None:
        self.settings = settings
        self.store = store
        self.interval = interval
        self.reload_interval = reload_interval
        self.ids = IdAllocator(store, batch=100)
        self.server_id = self.ids.alloc()
        self.election = Election(
            store,
            NodeSession(self.server_id, address, __version__, time.time(), SessionState.HEALTHY),
            settings.session_ttl,
            on_lost=self._lost,
        )
        self.channels = ChannelManager(store, settings, self.ids)
        self.segments: SegmentManager | None = None
        self.reloader: MetaReloader | None = None
        self.recovered: list[FlushRecovery] = []
        self.active = threading.Event()
        self._last_reload = 0.0

    # --- step functions (also for a sensor) ------------------------------------------------

    def activate(self) -> list[FlushRecovery]:
        """What the new active coordinator does first: load segment meta, complete
        Flushing segments whose checkpoint passed (recover_flushing)."""
        self.segments = SegmentManager(self.store, self.settings, self.ids)
        self.reloader = MetaReloader(self.store, self.segments)
        self.recovered = self.segments.recover_flushing()
        self.reloader.reload()
        self._last_reload = time.monotonic()
        self.active.set()
        log.info(
            "datacoord %s is active (%d flushing segments recovered)", self.server_id, len(self.recovered)
        )
        return self.recovered

    def tick(self, now: float | None = None) -> CoordinatorTick:
        """One round: channel reconcile, seal policies, and the meta reload when due."""
        if self.segments is None or self.reloader is None:
            self.activate()
        assert self.segments is not None and self.reloader is not None
        now = time.time() if now is None else now
        report = self.channels.reconcile(now)
        sealed = tuple(self.segments.seal_by_policy(now))
        reloaded = False
        if time.monotonic() - self._last_reload >= self.reload_interval:
            reloaded = self.reloader.reload()
            self._last_reload = time.monotonic()
        return CoordinatorTick(report, sealed, reloaded)

    # --- long-running ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Campaign; while active, tick every `interval`; on leadership loss campaign again.
        On `stop`, resign (a standby takes over at once)."""
        try:
            while not stop.is_set():
                if not self.election.campaign(timeout=self.interval):
                    continue
                log.info("datacoord %s won the election", self.server_id)
                try:
                    self.activate()
                    while not stop.is_set() and self.election.is_leader:
                        try:
                            self.tick()
                        except MetaError as exc:
                            log.warning("datacoord tick failed (%s); retrying", exc)
                        stop.wait(self.interval)
                except MetaError as exc:
                    log.warning("datacoord activation failed (%s); campaigning again", exc)
                    self.election.resign()
                self.active.clear()
                self.segments = None
        finally:
            self.active.clear()
            self.election.resign()
            log.info("datacoord %s stopped", self.server_id)

    def _lost(self) -> None:
        self.active.clear()
        log.error("datacoord %s lost its leadership: standing by", self.server_id)
