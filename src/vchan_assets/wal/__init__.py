"""The log (vchannels): a write-ahead log of Parquet files per vchannel on object storage.

`format` fixes the file format; `WalWriter` appends batches, `WalReader` lists, validates
and reads them. The proxy role (`wal.producer.Producer`: routing, segment assignment, time
ticks, DDL) sits above DataCoord, so it is imported from its own module.
"""

from vchan_assets.wal.format import (
    CorruptLogError,
    LogError,
    MsgType,
    SchemaMismatchError,
    UnknownMessageTypeError,
    log_schema,
)
from vchan_assets.wal.reader import Backlog, WalFile, WalReader, read_log_file
from vchan_assets.wal.writer import InvalidBatchError, LogConflictError, WalWriter, channel_lock

__all__ = [
    "Backlog",
    "CorruptLogError",
    "InvalidBatchError",
    "LogConflictError",
    "LogError",
    "MsgType",
    "SchemaMismatchError",
    "UnknownMessageTypeError",
    "WalFile",
    "WalReader",
    "WalWriter",
    "channel_lock",
    "log_schema",
    "read_log_file",
]
