"""etcd metastore: key layout, codec, CAS and lease-guarded transactions, sessions, watch,
ID allocator and timestamp oracle."""

from vchan_assets.meta.errors import (
    CasConflictError,
    LeaseLostError,
    MalformedValueError,
    MetaError,
    MetaUnavailableError,
)
from vchan_assets.meta.keys import Keys
from vchan_assets.meta.store import KeyValue, MetaStore, Snapshot

__all__ = [
    "CasConflictError",
    "KeyValue",
    "Keys",
    "LeaseLostError",
    "MalformedValueError",
    "MetaError",
    "MetaStore",
    "MetaUnavailableError",
    "Snapshot",
]
