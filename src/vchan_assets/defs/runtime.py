"""What the Dagster layer asks of the system, as a plain class (no Dagster import).

`VchanRuntime` is the `System` of one run or sensor tick (`open_runtime` opens it
through `Stack`) and passes each question on to the layer
that answers it: collections (`datacoord.collections`), a channel's state and sync
decision (`datanode.channel_state`, `datanode.policies`), the sync itself
(`datanode.sync`), the invariant checks (`datanode.checks`) and the segment table
(`catalog`). It holds no logic of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry, VchannelNotFoundError
from vchan_assets.datacoord.leases import current_lease
from vchan_assets.datacoord.recovery import channel_checkpoint, channel_segments
from vchan_assets.datanode import checks
from vchan_assets.datanode.channel_state import read_channel_state
from vchan_assets.datanode.checks import CheckOutcome
from vchan_assets.datanode.policies import ChannelBacklog, channel_backlog, sync_reasons
from vchan_assets.datanode.sync import SyncResult, SyncTask
from vchan_assets.model import ChannelLease, CollectionInfo, MsgPosition, SegmentInfo
from vchan_assets.spark import Engine
from vchan_assets.stack import Stack
from vchan_assets.system import System
from vchan_assets.wal.reader import WalReader

# A Spark job of a sync that takes longer is cancelled (a hung Python worker must not
# hold the channel's run slot for the 600 s default); the sensor asks again.
SYNC_JOB_TIMEOUT = 120.0


@dataclass(frozen=True)
class ChannelStatus:
    vchannel: str
    collection: CollectionInfo
    backlog: ChannelBacklog
    lease: ChannelLease | None  # who may write the channel's meta; None: no node watches it


@dataclass(frozen=True)
class VchanRuntime(System):
    """The system of one run or sensor tick (`open_runtime`), and the questions Dagster asks it."""

    # --- channels ---------------------------------------------------------------------

    def collections(self) -> list[CollectionInfo]:
        return CollectionRegistry(self.store).list()

    def vchannels(self) -> dict[str, CollectionInfo]:
        return {v: info for info in self.collections() for v in info.vchannels}

    def collection_of(self, vchannel: str) -> CollectionInfo:
        found = self.vchannels().get(vchannel)
        if found is None:
            raise VchannelNotFoundError(vchannel)
        return found

    def status(self, vchannel: str, collection: CollectionInfo | None = None) -> ChannelStatus:
        """The channel's backlog for the sync policies, and its current lease."""
        info = collection or self.collection_of(vchannel)
        state = read_channel_state(self.store, WalReader(self.storage, vchannel, info))
        return ChannelStatus(vchannel, info, channel_backlog(state), self.store.read_lease(vchannel))

    def sync_reasons(self, status: ChannelStatus, now: float | None = None) -> list[str]:
        return sync_reasons(status.backlog, self.settings, now)

    def sync(self, vchannel: str, lease_id: int, engine: Engine = "spark") -> SyncResult:
        """One sync of `vchannel` by the holder of `lease_id` (LeaseLostError if it moved),
        on this system's Spark session (`with_spark`: the pyspark resource's) when it has one."""
        info = self.collection_of(vchannel)
        lease = current_lease(self.store, vchannel, lease_id)
        task = SyncTask(self, info, vchannel, lease, engine, SYNC_JOB_TIMEOUT)
        return task.run()

    def checkpoint(self, vchannel: str) -> MsgPosition | None:
        cp = channel_checkpoint(self.store, vchannel)
        return cp.model if cp else None

    def segments(self, vchannel: str | None = None) -> list[SegmentInfo]:
        """The segments of one vchannel, or of every collection."""
        if vchannel is None:
            return self.catalog().segment_infos()
        return [d.model for d in channel_segments(self.store, self.collection_of(vchannel).id, vchannel)]

    # --- invariant checks (datanode.checks) ------------------------------------------------

    def check_log_rows(self, vchannel: str) -> CheckOutcome:
        return checks.check_log_rows(self.store, self.storage, self.collection_of(vchannel), vchannel)

    def check_unique_pks(self, vchannel: str) -> CheckOutcome:
        return checks.check_unique_pks(self.store, self.storage, self.collection_of(vchannel), vchannel)

    def check_binlog_paths(self, vchannel: str) -> CheckOutcome:
        return checks.check_binlog_paths(self.store, self.storage, self.collection_of(vchannel), vchannel)

    # --- catalog ------------------------------------------------------------------------

    def catalog(self) -> Catalog:
        return Catalog(self)


@contextmanager
def open_runtime(settings: Settings) -> Iterator[VchanRuntime]:
    """Open the system for a Dagster sensor or run: VCHAN_ETCD_ENDPOINTS, or the embedded
    etcd `vchan up` started. Never starts one: a Dagster daemon left running after
    `vchan down` fails its ticks (EmbeddedEtcdError) instead of restarting etcd."""
    stack = Stack.open(settings, start_etcd=False)
    try:
        yield VchanRuntime(settings, stack.store, stack.storage)
    finally:
        stack.close(stop_etcd=False)
