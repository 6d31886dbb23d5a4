"""Registered change streams: what each streaming query's sink has committed, so log
retention keeps what the stream has yet to read.

A change stream (`spark.readStream.format("vchan")`, `query.stream_source`) writes
`meta/stream/{stream}`, a `StreamRecord`, when it first plans a micro-batch (its start
offsets; a stream that starts over under its id lowers the record to them) and again at
each Spark commit (the end offsets of the batch its sink holds);
planning refreshes `last_seen` at most every `TOUCH_INTERVAL`. Log retention
(`lifecycle.gc`) keeps every log file holding an offset after the smallest committed
offset of a vchannel over the streams seen within VCHAN_STREAM_IDLE_TIMEOUT
(`retention_holds`): a stream that stopped for good (its query deleted, its checkpoint
thrown away) stops holding the log back once that time has passed, and then finds its
offsets gone (`StreamOffsetRemovedError` in the stream source) if it ever comes back.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, StreamOffset, StreamRecord

STREAM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TOUCH_INTERVAL = 30.0  # seconds between two refreshes of `last_seen` by planning alone


def valid_stream_id(stream_id: str) -> bool:
    """A stream id is one etcd key segment: letters, digits, '.', '_', '-' (128 at most)."""
    return STREAM_ID.fullmatch(stream_id) is not None


def record_stream(
    store: MetaStore, stream_id: str, collection: CollectionInfo, offsets: Mapping[str, int], now: float
) -> StreamRecord:
    """Write the stream's committed `offsets` (vchannel -> last offset its sink holds)."""
    record = StreamRecord(
        collection.id,
        collection.name,
        tuple(StreamOffset(v, int(o)) for v, o in sorted(offsets.items())),
        now,
        socket.gethostname(),
        os.getpid(),
    )
    store.put(store.keys.stream(stream_id), record)
    return record


def get_stream(store: MetaStore, stream_id: str) -> StreamRecord | None:
    found = store.get_model(store.keys.stream(stream_id), StreamRecord)
    return None if found is None else found.model


def touch_stream(
    store: MetaStore, stream_id: str, collection: CollectionInfo, start: Mapping[str, int], now: float
) -> StreamRecord:
    """The stream is alive and goes on from `start`: register it there if it is not
    registered (or was for another collection), else refresh its `last_seen` and keep its
    committed offsets, lowered to `start` where the stream went back (a new Spark
    checkpoint under an old stream id)."""
    found = get_stream(store, stream_id)
    if found is None or found.collection_id != collection.id:
        return record_stream(store, stream_id, collection, start, now)
    committed = {o.vchannel: o.offset for o in found.offsets}
    held = {v: min(o, committed.get(v, o)) for v, o in start.items()}
    return record_stream(store, stream_id, collection, held, now)


def list_streams(store: MetaStore) -> dict[str, StreamRecord]:
    """Every registered stream by id (malformed records skipped, as other listings do)."""
    found, _ = store.list_models(store.keys.stream.prefix, StreamRecord, True)
    prefix = store.keys.stream.prefix
    return {d.kv.key.removeprefix(prefix): d.model for d in found}


def is_idle(record: StreamRecord, now: float, idle_timeout: float) -> bool:
    return now - record.last_seen > idle_timeout


def retention_holds(store: MetaStore, now: float, idle_timeout: float) -> dict[str, int]:
    """vchannel -> the smallest offset a stream seen within `idle_timeout` has committed:
    log retention keeps every file holding an offset after it."""
    holds: dict[str, int] = {}
    for record in list_streams(store).values():
        if is_idle(record, now, idle_timeout):
            continue
        for o in record.offsets:
            holds[o.vchannel] = min(o.offset, holds.get(o.vchannel, o.offset))
    return holds
