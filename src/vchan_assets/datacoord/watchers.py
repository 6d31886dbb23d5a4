"""DataCoord's fallback write path for watch infos without a lease id (lease MEP,
"compatibility"): a DataNode told to watch a channel by an older coordinator has no lease
id, so before each commit it asks DataCoord, which checks that the node really is the
channel's watcher (`channelwatch/{node}/{vchannel}` is WatchSuccess (or ToWatch), as Milvus'
SaveBinlogPaths checks the watcher id) and then hands out the lease to commit under.
"""

from __future__ import annotations

from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.errors import MalformedValueError, MetaError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelLease, ChannelWatchInfo, WatchState


class NotWatcherError(MetaError):
    """A node asked to write a channel it does not watch."""

    def __init__(self, vchannel: str, node_id: int, state: str) -> None:
        super().__init__(f"node {node_id} is not the watcher of {vchannel} ({state}): write refused")
        self.vchannel = vchannel
        self.node_id = node_id
        self.state = state


def lease_for_watcher(
    store: MetaStore, vchannel: str, node_id: int, ids: IdAllocator | None = None
) -> ChannelLease:
    """The lease `node_id` commits `vchannel` under, if it is the channel's watcher.

    Refuses (NotWatcherError) unless `channelwatch/{node_id}/{vchannel}` is WatchSuccess
    (or ToWatch: the node is carrying the watch out).
    Reuses the lease already held by this node; otherwise grants a new one for it (which
    fences off whoever wrote before)."""
    key = store.keys.channel_watch(node_id, vchannel)
    try:
        found = store.get_model(key, ChannelWatchInfo)
    except MalformedValueError as exc:
        raise NotWatcherError(vchannel, node_id, f"malformed watch info: {exc.reason}") from None
    if found is None:
        raise NotWatcherError(vchannel, node_id, "no watch info")
    if found.model.state not in (WatchState.WATCH_SUCCESS, WatchState.TO_WATCH):
        raise NotWatcherError(vchannel, node_id, f"state {found.model.state.value}")
    current = store.read_lease(vchannel)
    if current is not None and current.node_id == node_id:
        return current
    return grant_channel_lease(store, ids or IdAllocator(store), vchannel, node_id)
