"""Channel leases: who may write a vchannel's meta (the lease design of Milvus' "DataNode
removes its dependency on DataCoord").

The coordinator grants a fresh lease id whenever it (re)assigns a channel; the id
travels in the watch info, and every meta write of the channel is a transaction
comparing `channel-lease/{vchannel}` with it (`MetaStore.guarded_txn`). Granting a
new lease therefore fences off the previous holder at once.
"""

from __future__ import annotations

import time

from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.errors import LeaseLostError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelLease


def new_channel_lease(ids: IdAllocator, node_id: int) -> ChannelLease:
    """A lease for `node_id` with a fresh id, not yet written (the caller writes it in the
    transaction that needs it, e.g. together with the ToWatch that names it)."""
    return ChannelLease(lease_id=ids.alloc(), node_id=node_id, granted_at=time.time())


def grant_channel_lease(store: MetaStore, ids: IdAllocator, vchannel: str, node_id: int) -> ChannelLease:
    """A new lease for `node_id`, replacing (and so revoking) any previous one."""
    lease = new_channel_lease(ids, node_id)
    store.put(store.keys.channel_lease(vchannel), lease)
    return lease


def current_lease(store: MetaStore, vchannel: str, lease_id: int) -> ChannelLease:
    """The channel's lease if it is still `lease_id`; LeaseLostError otherwise."""
    lease = store.read_lease(vchannel)
    if lease is None or lease.lease_id != lease_id:
        raise LeaseLostError(vchannel, lease_id, None if lease is None else lease.lease_id)
    return lease
