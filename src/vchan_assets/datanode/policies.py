"""When to sync a channel: small named policies, as in Milvus' writebuffer sync policies.

Each policy looks at a channel's backlog and returns a reason (str) or None.
`sync_reasons` lists every policy that fires; a sensor or a node loop syncs when it
is not empty. `channel_backlog` builds the input from the channel's read model
(`datanode.channel_state`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from vchan_assets.config import Settings
from vchan_assets.datanode.channel_state import ChannelState
from vchan_assets.model import MsgPosition, physical_ms

MiB = 1 << 20


@dataclass(frozen=True)
class ChannelBacklog:
    vchannel: str
    checkpoint: MsgPosition
    head: MsgPosition | None  # latest time tick in the log
    unsynced_bytes: int = 0  # log bytes past the checkpoint
    oldest_unsynced_ts: int | None = None  # timestamp of the oldest unsynced batch
    sealed_segments: int = 0  # Sealed/Flushing segments waiting for a sync
    flush_ts: int | None = None  # pending flush timestamp of the collection

    @property
    def has_unsynced(self) -> bool:
        return self.head is not None and self.head.offset > self.checkpoint.offset


Policy = Callable[[ChannelBacklog, Settings, float], str | None]


def buffered_size(b: ChannelBacklog, s: Settings, now: float) -> str | None:
    limit = s.sync_buffer_mb * MiB
    if b.has_unsynced and b.unsynced_bytes >= limit:
        return f"buffered {b.unsynced_bytes / MiB:.1f} MiB >= {s.sync_buffer_mb:g} MiB"
    return None


def oldest_unsynced_row(b: ChannelBacklog, s: Settings, now: float) -> str | None:
    if not b.has_unsynced or b.oldest_unsynced_ts is None:
        return None
    age = now - physical_ms(b.oldest_unsynced_ts) / 1000
    if age >= s.sync_max_age:
        return f"oldest unsynced row is {age:.0f}s old >= {s.sync_max_age:g}s"
    return None


def sealed_segment(b: ChannelBacklog, s: Settings, now: float) -> str | None:
    if b.sealed_segments:
        return f"{b.sealed_segments} sealed segment(s) to flush"
    return None


def flush_timestamp(b: ChannelBacklog, s: Settings, now: float) -> str | None:
    if b.flush_ts is not None and b.checkpoint.timestamp < b.flush_ts and b.has_unsynced:
        return f"flush requested at ts {b.flush_ts}"
    return None


SYNC_POLICIES: tuple[Policy, ...] = (
    buffered_size,
    oldest_unsynced_row,
    sealed_segment,
    flush_timestamp,
)


def sync_reasons(b: ChannelBacklog, s: Settings, now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    return [reason for policy in SYNC_POLICIES if (reason := policy(b, s, now))]


def channel_backlog(state: ChannelState) -> ChannelBacklog:
    """What the sync policies look at, from the channel's read model.

    Both hosts of a DataNode (the `vchan datanode` loop and the Dagster sync sensor) decide
    from this one function. Sealed segments count once the log's head passed their seal
    timestamp (a sync now would flush them: counting earlier ones made a node sync again
    and again for nothing); the flush target is the earliest seal timestamp the checkpoint
    has not passed (nothing writes a flush key: the seal timestamps are the record)."""
    return ChannelBacklog(
        vchannel=state.vchannel,
        checkpoint=state.checkpoint,
        head=state.head,
        unsynced_bytes=state.backlog.size_bytes,
        oldest_unsynced_ts=state.backlog.oldest_timestamp,
        sealed_segments=len(state.ready_to_flush),
        flush_ts=state.flush_ts,
    )
