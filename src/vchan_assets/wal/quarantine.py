"""Getting a vchannel past a damaged log file (`vchan quarantine --file PATH`).

A log file that cannot be read stops its channel: every sync from a checkpoint before it
needs it. An operator who accepts the loss quarantines it; in this order, so a crash at any
step leaves the loss recorded, never a silent hole:

1. the loss is recorded in etcd (`meta/data-loss/{collection}/{loss}`, a `DataLoss`: the
   channel, the offsets lost, the file, why it was unreadable), for good: `vchan status`
   warns of it and the catalog lists it (`Catalog.data_losses`);
2. the damaged file is copied to `quarantine/{its key}` (kept for forensics) and removed;
3. a placeholder takes its name: as many time ticks as the file had messages (the count is
   the next file's first offset, or the channel head's next offset, minus its own), at the
   previous file's last timestamp, so the log has no gap and a sync goes on past it.

Only a file that really is unreadable is quarantined (`NotDamagedError` otherwise: a
placeholder reads, so a second run refuses); a run that stopped half-way is finished by the
next one under the loss it recorded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.errors import DeclaredError
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.model import ChannelHead, CollectionInfo, DataLoss
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal import format as fmt
from vchan_assets.wal.format import CorruptLogError, LogError, MsgType, first_offset_of, log_schema
from vchan_assets.wal.reader import WalReader, read_log_file

log = logging.getLogger(__name__)

QUARANTINE_PREFIX = "quarantine/"


class NotDamagedError(DeclaredError, LogError):
    """`vchan quarantine` was given a file it can read: nothing is quarantined."""

    path: str
    why: str
    message = "{path} is not quarantined: {why}"


@dataclass(frozen=True)
class DamagedLogFile:
    """What quarantining a damaged log file would do: for the confirmation prompt."""

    key: str
    path: str
    collection: CollectionInfo
    vchannel: str
    first_offset: int
    last_offset: int
    reason: str
    timestamp: int  # the placeholder's time ticks

    def describe(self) -> str:
        count = self.last_offset - self.first_offset + 1
        return (
            f"{self.path}: {self.reason}\n"
            f"quarantining it loses offsets {self.first_offset}..{self.last_offset} ({count} messages) "
            f"of {self.vchannel} (collection {self.collection.name}); the loss is recorded in etcd for good"
        )


def key_of(storage: Storage, path: str) -> str:
    """The storage key of `path`, given as a full path (as errors name files) or a key."""
    return storage.key_of(path) if path.startswith("/") or "://" in path else path


def _collection_of(system: System, vchannel: str) -> CollectionInfo:
    for info in CollectionRegistry(system.store).list(include_dropped=True):
        if vchannel in info.vchannels:
            return info
    raise NotDamagedError(vchannel, "no collection has this vchannel")


def inspect_log_file(system: System, path: str) -> DamagedLogFile:
    """The damaged log file at `path` (a storage path or key) and what its loss would be;
    NotDamagedError if it is not a log file, or can be read."""
    storage = system.storage
    key = key_of(storage, path)
    parts = key.split("/")
    try:
        first = first_offset_of(key)
    except ValueError:
        first = -1
    if len(parts) != 3 or parts[0] != "wal" or first < 0:
        raise NotDamagedError(path, "not a log file (wal/{vchannel}/{offset}.parquet)")
    vchannel = parts[1]
    info = _collection_of(system, vchannel)
    reader = WalReader(storage, vchannel, info)
    keys = reader.keys()
    if key not in keys:
        raise NotDamagedError(storage.path(key), "no such log file")
    try:  # as a sync reads it: the footer, then the whole file and its data file
        reader.describe(key)
        messages = read_log_file(storage, key, info.schema).num_rows
    except CorruptLogError as exc:
        reason = exc.reason
    else:
        raise NotDamagedError(storage.path(key), f"it reads ({messages} messages)")
    at = keys.index(key)
    if at + 1 < len(keys):
        end = first_offset_of(keys[at + 1])
    else:
        head = system.store.get_model(system.store.keys.wal_head(vchannel), ChannelHead)
        end = head.model.next_offset if head is not None else first + 1
    if end <= first:
        raise NotDamagedError(storage.path(key), f"cannot tell how many messages it held (next offset {end})")
    timestamp = 0
    if at > 0:
        try:
            before = reader.describe(keys[at - 1])
            timestamp = before.last_timestamp if before is not None else 0
        except CorruptLogError:
            timestamp = 0
    return DamagedLogFile(key, storage.path(key), info, vchannel, first, end - 1, reason, timestamp)


def quarantine_log_file(system: System, damaged: DamagedLogFile) -> DataLoss:
    """Record the loss, move the file to `quarantine/`, put the placeholder in its place."""
    store, storage = system.store, system.storage
    recorded = [
        loss
        for loss in list_data_losses(system, damaged.collection.id)
        if (loss.vchannel, loss.first_offset) == (damaged.vchannel, damaged.first_offset)
    ]  # an earlier run that stopped half-way
    loss = (
        recorded[0]
        if recorded
        else DataLoss(
            loss_id=IdAllocator(store).alloc(),
            collection_id=damaged.collection.id,
            kind="log",
            path=damaged.path,
            moved_to=storage.path(QUARANTINE_PREFIX + damaged.key),
            reason=damaged.reason,
            vchannel=damaged.vchannel,
            first_offset=damaged.first_offset,
            last_offset=damaged.last_offset,
            at=time.time(),
        )
    )
    if not recorded:
        record_loss(system, loss)
    move_to_quarantine(storage, damaged.key)
    storage.write_atomic(damaged.key, _placeholder(damaged))
    log.warning(
        "quarantined %s to %s: offsets %d..%d of %s lost",
        loss.path,
        loss.moved_to,
        loss.first_offset,
        loss.last_offset,
        loss.vchannel,
    )
    return loss


def record_loss(system: System, loss: DataLoss) -> None:
    """Write `loss` under a new key (it is never changed or deleted)."""
    system.store.cas(system.store.keys.data_loss(loss.collection_id, loss.loss_id), 0, loss)


def move_to_quarantine(storage: Storage, key: str) -> str:
    """Copy the file at `key` to `quarantine/{key}` and remove it; the new full path."""
    kept = storage.write_atomic(QUARANTINE_PREFIX + key, storage.read_bytes(key))
    storage.delete(key)
    return kept


def _placeholder(damaged: DamagedLogFile) -> pa.Buffer:
    """A valid log file of time ticks holding the lost offsets' place."""
    schema = log_schema(damaged.collection.schema)
    n = damaged.last_offset - damaged.first_offset + 1
    columns = {f.name: pa.nulls(n, f.type) for f in schema}
    columns["offset"] = pa.array(range(damaged.first_offset, damaged.last_offset + 1), pa.int64())
    columns["msg_type"] = pa.array([MsgType.TIME_TICK.value] * n, pa.string())
    columns["timestamp"] = pa.array([damaged.timestamp] * n, pa.int64())
    meta = {
        fmt.META_CHANNEL: damaged.vchannel.encode(),
        fmt.META_COLLECTION: str(damaged.collection.id).encode(),
        fmt.META_FIRST_OFFSET: str(damaged.first_offset).encode(),
        fmt.META_COUNT: str(n).encode(),
        fmt.META_LAST_TS: str(damaged.timestamp).encode(),
    }
    table = pa.table(columns, schema=schema).replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue()


def list_data_losses(system: System, collection_id: int | None = None) -> list[DataLoss]:
    """Every recorded loss (of one collection if given), oldest first."""
    store = system.store
    prefix = (
        store.keys.data_loss.prefix if collection_id is None else store.keys.data_loss.under(collection_id)
    )
    found, _ = store.list_models(prefix, DataLoss, skip_malformed=True)
    return sorted((d.model for d in found), key=lambda loss: loss.at)
