"""One read model of a vchannel's state, for everyone who asks where a channel stands.

`read_channel_state(store, reader)` reads, once:

- the channel checkpoint from etcd, with its version (before the first sync: the
  collection's start position for the vchannel);
- the log after the checkpoint: its files (found by name, no older file is opened:
  `WalReader.files_after`), the unsynced bytes, the oldest unsynced timestamp and the
  head (the latest time tick; the checkpoint itself when none follows it);
- the channel's segments with their versions;

and derives what a sync would do now: the sealed segments it would flush (those whose
seal timestamp the head has passed) and the flush target (the earliest seal timestamp of
a sealed segment that the checkpoint has not passed yet).

The sync policies of both hosts (the `vchan datanode` loop and the Dagster sync sensor),
`SyncTask` (its start, its end and the segment versions it commits against), and the
catalog behind `vchan status` and `vchan metrics` all read a channel through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vchan_assets.datacoord import segment_ops
from vchan_assets.datacoord.recovery import channel_checkpoint, channel_segments, start_position
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, SegmentInfo, SegmentState
from vchan_assets.wal.reader import Backlog, WalFile, WalReader


@dataclass(frozen=True)
class ChannelState:
    collection: CollectionInfo
    vchannel: str
    checkpoint: MsgPosition  # committed, or the start position before the first sync
    committed: Decoded[MsgPosition] | None  # the checkpoint key as read; None: never synced
    unsynced_files: tuple[WalFile, ...]  # the log files holding offsets after the checkpoint
    backlog: Backlog  # the log after the checkpoint (its head: the latest time tick there)
    segments: tuple[Decoded[SegmentInfo], ...]  # this vchannel's, with their etcd versions (if read)

    @property
    def head(self) -> MsgPosition | None:
        """The latest time tick: after the checkpoint, else the committed checkpoint (a
        time tick itself); None before the first sync if no tick follows the start."""
        if self.backlog.head is not None:
            return self.backlog.head
        return self.committed.model if self.committed else None

    @property
    def end_offset(self) -> int:
        """Offset after the last message of the log (its files after the checkpoint end there)."""
        files = self.unsynced_files
        return files[-1].end_offset if files else max(self.checkpoint.offset + 1, 0)

    @property
    def has_unsynced(self) -> bool:
        return self.head is not None and self.head.offset > self.checkpoint.offset

    @property
    def syncs(self) -> int:
        """Committed syncs: each moves the checkpoint key once (its etcd version)."""
        return self.committed.kv.version if self.committed else 0

    def in_state(self, *states: SegmentState) -> list[SegmentInfo]:
        return [d.model for d in self.segments if d.model.state in states]

    @property
    def ready_to_flush(self) -> list[SegmentInfo]:
        """Sealed segments a sync now would flush: the head passed their seal timestamp."""
        head = self.head
        return (
            []
            if head is None
            else [s for s in self.in_state(*segment_ops.SEALABLE) if segment_ops.ready_to_flush(s, head)]
        )

    @property
    def flush_ts(self) -> int | None:
        """The earliest seal timestamp of a sealed segment the checkpoint has not passed."""
        sealed = self.in_state(*segment_ops.SEALABLE)
        pending = [s.seal_ts for s in sealed if s.seal_ts > self.checkpoint.timestamp]
        return min(pending) if pending else None


def read_channel_state(store: MetaStore, reader: WalReader, segments: bool = True) -> ChannelState:
    """The state of `reader`'s vchannel (LogError/StorageError if its log is unreadable);
    without `segments`, its segments are not read (empty): where the log and the
    checkpoint are all a caller needs (`vchan status`)."""
    collection, vchannel = reader.collection, reader.vchannel
    committed = channel_checkpoint(store, vchannel)
    checkpoint = committed.model if committed else start_position(collection, vchannel)
    files = reader.files_after(checkpoint.offset)
    return ChannelState(
        collection,
        vchannel,
        checkpoint,
        committed,
        tuple(files),
        reader.backlog(checkpoint.offset, files),
        tuple(channel_segments(store, collection.id, vchannel)) if segments else (),
    )
