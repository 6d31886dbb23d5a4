"""DataCoord's fallback write path for watch infos without a lease id (the
"compatibility" part of the lease design of Milvus' "DataNode removes its dependency on
DataCoord"): a DataNode told to watch a channel by an older coordinator has no lease
id, so before each commit it asks DataCoord, which checks that the node really is the
channel's watcher (`channelwatch/{node}/{vchannel}` is WatchSuccess (or ToWatch), as Milvus'
SaveBinlogPaths checks the watcher id) and then hands out the lease to commit under.

The check and the grant are one transaction comparing the watch info and the lease key
with the versions read: a channel reassigned between the two keeps its new owner's lease.
"""

from __future__ import annotations

from vchan_assets.datacoord.leases import new_channel_lease
from vchan_assets.errors import DeclaredError
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.errors import CasConflictError, MalformedValueError, MetaError
from vchan_assets.meta.retry import retry_on_conflict
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelLease, ChannelWatchInfo, WatchState


class NotWatcherError(DeclaredError, MetaError):
    """A node asked to write a channel it does not watch."""

    vchannel: str
    node_id: int
    state: str
    message = "node {node_id} is not the watcher of {vchannel} ({state}): write refused"


def lease_for_watcher(
    store: MetaStore, vchannel: str, node_id: int, ids: IdAllocator | None = None
) -> ChannelLease:
    """The lease `node_id` commits `vchannel` under, if it is the channel's watcher.

    Refuses (NotWatcherError) unless `channelwatch/{node_id}/{vchannel}` is WatchSuccess
    (or ToWatch: the node is carrying the watch out).
    Reuses the lease already held by this node; otherwise grants a new one for it (which
    fences off whoever wrote before), unless the watch info or the lease changed since
    they were read (then both are read again)."""
    allocator = ids or IdAllocator(store)
    return retry_on_conflict(
        f"lease of {vchannel} for node {node_id}",
        lambda: _grant_to_watcher(store, vchannel, node_id, allocator),
    )


def _grant_to_watcher(store: MetaStore, vchannel: str, node_id: int, ids: IdAllocator) -> ChannelLease:
    key = store.keys.channel_watch(node_id, vchannel)
    try:
        found = store.get_model(key, ChannelWatchInfo)
    except MalformedValueError as exc:
        raise NotWatcherError(vchannel, node_id, f"malformed watch info: {exc.reason}") from None
    if found is None:
        raise NotWatcherError(vchannel, node_id, "no watch info")
    if found.model.state not in (WatchState.WATCH_SUCCESS, WatchState.TO_WATCH):
        raise NotWatcherError(vchannel, node_id, f"state {found.model.state.value}")
    lease_key = store.keys.channel_lease(vchannel)
    current = store.get_model(lease_key, ChannelLease)
    if current is not None and current.model.node_id == node_id:
        return current.model
    lease = new_channel_lease(ids, node_id)
    lease_version = current.kv.version if current else 0
    if store.txn({key: found.kv.version, lease_key: lease_version}, {lease_key: lease}) is None:
        raise CasConflictError(lease_key, lease_version, -1)
    return lease
