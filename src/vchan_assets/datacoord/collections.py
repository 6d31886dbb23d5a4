"""Collections and partitions in etcd (the part of Milvus' RootCoord meta this system needs).

A collection is stored as `CollectionInfo` at `meta/collection/{id}`; its name is
reserved by `meta/collection-name/{name}` (value: the collection id), created in the
same transaction, so two concurrent creates of one name cannot both win. Every change
is a compare-version-and-swap on the version read, retried after a conflict.

Dropping a collection keeps its `CollectionInfo` (marked `dropped_at`): DataNodes still
need the schema to read what is left of its log; the name is freed at once. The
matching DDL messages in the log are the producer's job (`wal.producer`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from vchan_assets.errors import DeclaredError
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.codec import decode, decode_dict, encode
from vchan_assets.meta.errors import CasConflictError, MalformedValueError, MetaError
from vchan_assets.meta.retry import retry_on_conflict
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition

DEFAULT_PARTITION = "_default"
MAX_NAME_LENGTH = 255
MAX_CHANNELS = 64
MAX_PARTITIONS = 4096  # as Milvus' rootCoord.maxPartitionNum
# Milvus' partition key: 16 hidden partitions by default, at most 1024.
DEFAULT_KEY_PARTITIONS = 16
MAX_KEY_PARTITIONS = 1024

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class CollectionError(MetaError):
    """Base class of collection and partition errors."""


class InvalidNameError(DeclaredError, CollectionError, ValueError):
    kind: str
    name: str
    message = (
        "invalid {kind} name {name!r}: use letters, digits and underscores, not starting "
        f"with a digit, at most {MAX_NAME_LENGTH} characters"
    )


class InvalidSchemaError(DeclaredError, CollectionError, ValueError):
    name: str
    reason: str
    message = "collection {name!r}: invalid schema: {reason}"


class CollectionExistsError(DeclaredError, CollectionError):
    name: str
    collection_id: int | None
    message = "collection {name!r} already exists (id {collection_id})"


class CollectionNotFoundError(DeclaredError, CollectionError, LookupError):
    ref: str | int

    def __str__(self) -> str:
        kind = "id" if isinstance(self.ref, int) else "name"
        return f"no collection with {kind} {self.ref!r}"


class VchannelNotFoundError(DeclaredError, CollectionError, LookupError):
    vchannel: str
    collection: str | None = None

    def __str__(self) -> str:
        if self.collection:
            return f"collection {self.collection!r} has no vchannel {self.vchannel!r}"
        return f"no collection has vchannel {self.vchannel!r}"


class PartitionExistsError(DeclaredError, CollectionError):
    collection: str
    partition: str
    message = "collection {collection!r} already has a partition {partition!r}"


class PartitionNotFoundError(DeclaredError, CollectionError, LookupError):
    collection: str
    partition: str
    message = "collection {collection!r} has no partition {partition!r}"


def validate_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name):
        raise InvalidNameError(kind, str(name))
    return name


def vchannel_names(root: str, collection_id: int, count: int) -> tuple[str, ...]:
    """Milvus-style names `{root}-dml_{i}_{collection_id}v{i}`, safe as a path component
    and an etcd key segment (characters other than letters, digits, `_.-` become `-`)."""
    prefix = _UNSAFE.sub("-", root)
    return tuple(f"{prefix}-dml_{i}_{collection_id}v{i}" for i in range(count))


def key_partitions(count: int) -> list[str]:
    """The hidden partitions of a collection with a partition key, as Milvus names them: a
    row goes to `_default_{hash(key) % count}`."""
    if not 1 <= count <= MAX_KEY_PARTITIONS:
        raise ValueError(f"num_partitions must be in [1, {MAX_KEY_PARTITIONS}], got {count}")
    return [f"{DEFAULT_PARTITION}_{i}" for i in range(count)]


def validate_schema(name: str, schema: CollectionSchema) -> None:
    """What a collection accepts: an int64 primary key, one or more vector fields (float
    vectors of a fixed dimension in [1, 32768], sparse float vectors), scalars of the types
    `FieldSchema.from_spec` reads."""
    if not schema.vector_fields:
        raise InvalidSchemaError(name, "at least one vector field is needed")
    for field in schema.fields:
        if field.is_vector and not field.is_sparse and (field.dim is None or not 0 < field.dim <= 32768):
            raise InvalidSchemaError(name, f"vector {field.name!r} needs a dim in [1, 32768]")
        if field.name in ("offset", "msg_type", "timestamp", "segment_id", "partition_id", "payload"):
            raise InvalidSchemaError(name, f"field name {field.name!r} is reserved by the log")


def _no_key_partitions(info: CollectionInfo, verb: str) -> None:
    key = info.schema.partition_key
    if key is not None:
        raise InvalidSchemaError(
            info.name, f"cannot {verb} a partition: its partitions follow its partition key {key.name!r}"
        )


class CollectionRegistry:
    """Create, find, list and drop collections and partitions in etcd."""

    def __init__(
        self, store: MetaStore, ids: IdAllocator | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.ids = ids or IdAllocator(store)
        self.clock = clock

    # --- keys --------------------------------------------------------------------------

    def _name_key(self, name: str) -> str:
        return f"{self.store.keys.root}/meta/collection-name/{name}"

    # --- reads -------------------------------------------------------------------------

    def get(self, collection_id: int, include_dropped: bool = False) -> CollectionInfo:
        found = self.store.get_model(self.store.keys.collection(collection_id), CollectionInfo)
        if found is None or (found.model.dropped_at and not include_dropped):
            raise CollectionNotFoundError(collection_id)
        return found.model

    def find(self, name: str) -> CollectionInfo | None:
        """The live collection called `name`, or None. The name's key and the record of the
        collection it named last time in this process are read together (one round trip);
        the record is read again only when the name points elsewhere now."""
        validate_name("collection", name)
        name_key = self._name_key(name)
        hint = (self.store.endpoints, name_key)
        last = _LAST_ID.get(hint)
        keys = [name_key] if last is None else [name_key, self.store.keys.collection(last)]
        named, *record = self.store.get_many(keys)
        if named is None:
            return None
        collection_id = _collection_id(named.key, named.value)
        _LAST_ID[hint] = collection_id
        if collection_id != last or not record or record[0] is None:
            try:
                return self.get(collection_id)
            except CollectionNotFoundError:
                return None
        info = decode(record[0].key, record[0].value, CollectionInfo)
        return None if info.dropped_at else info

    def get_by_name(self, name: str) -> CollectionInfo:
        found = self.find(name)
        if found is None:
            raise CollectionNotFoundError(name)
        return found

    def list(self, include_dropped: bool = False) -> list[CollectionInfo]:
        """Every collection, by id; malformed values are logged and skipped."""
        found, _ = self.store.list_models(
            self.store.keys.collection.prefix, CollectionInfo, skip_malformed=True
        )
        return [d.model for d in found if include_dropped or not d.model.dropped_at]

    # --- collections -------------------------------------------------------------------

    def create(
        self,
        name: str,
        schema: CollectionSchema,
        partitions: Sequence[str] = (DEFAULT_PARTITION,),
        num_channels: int = 2,
        ttl_seconds: int = 0,
        num_partitions: int = DEFAULT_KEY_PARTITIONS,
    ) -> CollectionInfo:
        """Create a collection with `num_channels` vchannels; `_default` is always a
        partition, or, when the schema has a partition key, `num_partitions` hidden ones
        (`_default_0` ...: `key_partitions`); rows expire after `ttl_seconds` (0: never).
        Raises CollectionExistsError if the name is taken."""
        validate_name("collection", name)
        validate_schema(name, schema)
        if not 1 <= num_channels <= MAX_CHANNELS:
            raise ValueError(f"num_channels must be in [1, {MAX_CHANNELS}], got {num_channels}")
        if ttl_seconds < 0:
            raise ValueError(f"ttl_seconds must be >= 0, got {ttl_seconds}")
        names = [DEFAULT_PARTITION] + [p for p in dict.fromkeys(partitions) if p != DEFAULT_PARTITION]
        if schema.partition_key is not None:
            if len(names) > 1:
                raise InvalidSchemaError(
                    name, "a collection with a partition key has no partitions of its own"
                )
            names = key_partitions(num_partitions)
        for partition in names:
            validate_name("partition", partition)
        if len(names) > MAX_PARTITIONS:
            raise ValueError(f"at most {MAX_PARTITIONS} partitions")
        if self.find(name) is not None:
            raise CollectionExistsError(name, self.get_by_name(name).id)
        collection_id = self.ids.alloc()
        first_partition = self.ids.alloc(len(names))
        info = CollectionInfo(
            id=collection_id,
            name=name,
            schema=schema,
            partitions=tuple(first_partition + i for i in range(len(names))),
            partition_names=tuple(names),
            vchannels=vchannel_names(self.store.keys.root, collection_id, num_channels),
            created_at=self.clock(),
            ttl_seconds=ttl_seconds,
        )
        name_key, key = self._name_key(name), self.store.keys.collection(collection_id)
        ok = (
            self.store.txn(
                {name_key: 0, key: 0},
                {name_key: encode({"collection_id": collection_id}), key: encode(info)},
            )
            is not None
        )
        if not ok:
            existing = self.find(name)
            raise CollectionExistsError(name, existing.id if existing else None)
        return info

    def drop(self, name: str) -> CollectionInfo:
        """Mark the collection dropped and free its name; returns the dropped info."""
        validate_name("collection", name)
        name_key = self._name_key(name)

        def attempt() -> CollectionInfo:
            name_kv = self.store.get(name_key)
            if name_kv is None:
                raise CollectionNotFoundError(name)
            key = self.store.keys.collection(_collection_id(name_kv.key, name_kv.value))
            found = self.store.get_model(key, CollectionInfo)
            if found is None or found.model.dropped_at:
                raise CollectionNotFoundError(name)
            dropped = replace(found.model, dropped_at=self.clock())
            revision = self.store.txn(
                {key: found.kv.version, name_key: name_kv.version},
                {key: encode(dropped)},
                deletes=[name_key],
            )
            if revision is None:  # the name or the collection changed since read
                now = self.store.get(key)
                raise CasConflictError(key, found.kv.version, now.version if now else 0)
            return dropped

        return retry_on_conflict(f"drop of collection {name!r}", attempt)

    def set_ttl(self, name: str, ttl_seconds: int) -> CollectionInfo:
        """Milvus' `collection.ttl.seconds` of a collection, changed (0: rows never expire);
        readers and the compaction trigger apply the new value from their next read of it."""
        if ttl_seconds < 0:
            raise ValueError(f"ttl_seconds must be >= 0, got {ttl_seconds}")
        collection = self.get_by_name(name)
        return self.update(collection.id, lambda info: replace(info, ttl_seconds=ttl_seconds))

    def set_start_positions(self, collection_id: int, positions: Sequence[MsgPosition]) -> CollectionInfo:
        """Record where each vchannel starts (the create_collection message)."""
        by_channel = {p.channel: p for p in positions}

        def change(info: CollectionInfo) -> CollectionInfo:
            unknown = set(by_channel) - set(info.vchannels)
            if unknown:
                raise ValueError(f"collection {info.name!r} has no vchannels {sorted(unknown)}")
            merged = {p.channel: p for p in info.start_positions} | by_channel
            ordered = tuple(merged[c] for c in info.vchannels if c in merged)
            return replace(info, start_positions=ordered)

        return self.update(collection_id, change)

    # --- partitions --------------------------------------------------------------------

    def create_partition(self, name: str, partition: str) -> tuple[CollectionInfo, int]:
        """Add a partition; returns the new info and the partition's id."""
        validate_name("partition", partition)
        collection = self.get_by_name(name)
        _no_key_partitions(collection, "create")
        partition_id = self.ids.alloc()

        def change(info: CollectionInfo) -> CollectionInfo:
            if partition in info.partition_names:
                raise PartitionExistsError(name, partition)
            if len(info.partitions) >= MAX_PARTITIONS:
                raise ValueError(f"collection {name!r} already has {MAX_PARTITIONS} partitions")
            return replace(
                info,
                partitions=(*info.partitions, partition_id),
                partition_names=(*info.partition_names, partition),
            )

        return self.update(collection.id, change), partition_id

    def drop_partition(self, name: str, partition: str) -> tuple[CollectionInfo, int]:
        """Remove a partition (not `_default`); returns the new info and the dropped id."""
        if partition == DEFAULT_PARTITION:
            raise ValueError("the _default partition cannot be dropped")
        collection = self.get_by_name(name)
        _no_key_partitions(collection, "drop")
        dropped: list[int] = []

        def change(info: CollectionInfo) -> CollectionInfo:
            if partition not in info.partition_names:
                raise PartitionNotFoundError(name, partition)
            i = info.partition_names.index(partition)
            dropped[:] = [info.partitions[i]]
            return replace(
                info,
                partitions=info.partitions[:i] + info.partitions[i + 1 :],
                partition_names=info.partition_names[:i] + info.partition_names[i + 1 :],
            )

        return self.update(collection.id, change), dropped[0]

    # --- writes ------------------------------------------------------------------------

    def update(
        self, collection_id: int, change: Callable[[CollectionInfo], CollectionInfo]
    ) -> CollectionInfo:
        """Read-modify-write of a live collection with compare-and-swap, retried on conflict."""
        key = self.store.keys.collection(collection_id)

        def attempt() -> CollectionInfo:
            found = self.store.get_model(key, CollectionInfo)
            if found is None or found.model.dropped_at:
                raise CollectionNotFoundError(collection_id)
            new = change(found.model)
            self.store.cas(key, found.kv.version, new)
            return new

        return retry_on_conflict(f"update of collection {collection_id}", attempt)


# (etcd endpoints, name key) -> the collection id the name pointed to at its last read here.
_LAST_ID: dict[tuple[tuple[str, ...], str], int] = {}


def _collection_id(key: str, raw: bytes) -> int:
    """The collection id a name key points to."""
    collection_id = decode_dict(key, raw).get("collection_id")
    if not isinstance(collection_id, int) or isinstance(collection_id, bool):
        raise MalformedValueError(key, "expected {'collection_id': int}")
    return collection_id
