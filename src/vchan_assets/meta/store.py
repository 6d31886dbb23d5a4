"""The metastore: etcd v3 through the `etcd3` client, with typed errors and bounded waits.

Why `MultiEndpointEtcd3Client` with a short `time_retry`: the client marks an endpoint
failed after one connection error and refuses every call to it for `time_retry`
seconds (300 s by default). With 0.5 s, a restarted etcd is used again at once.
Every call has the settings' timeout, so an etcd that is down gives a
`MetaUnavailableError` within a bounded time, never a hang.

Reads of a prefix are paged, as Milvus' `WalkWithPrefix`: `PAGE_KEYS` keys a range
request, each page from the last key + NUL, every page at the revision of the first, so a
caller gets one snapshot of a prefix of any size and no response nears gRPC's 4 MiB
receive limit; a listing of several prefixes asks for their first pages in one read-only
transaction (one round trip for a small collection's segments, indexes and builds). Keys
that share no prefix (an index's targets, a collection's checkpoints) are read at one
revision in transactions of range requests (`get_at`, `get_many`). Every key and byte etcd
returns to a read is counted (`keys_read`, `bytes_read`). Writes are bounded: a value over
`MAX_VALUE_BYTES` and a transaction over etcd's `MAX_TXN_OPS` operations or
`MAX_REQUEST_BYTES` are refused before they are sent, with an error naming them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import etcd3
import etcd3.exceptions
import grpc
from etcd3 import etcdrpc

from vchan_assets.config import Settings
from vchan_assets.failpoints import failpoint
from vchan_assets.meta.codec import Model, decode, encode
from vchan_assets.meta.errors import (
    CasConflictError,
    LeaseLostError,
    MalformedValueError,
    MetaAccessError,
    MetaError,
    MetaUnavailableError,
    NotLeaderError,
    RevisionCompactedError,
    TransactionTooLargeError,
    ValueTooLargeError,
)
from vchan_assets.meta.keys import Keys
from vchan_assets.model import ChannelLease, SegmentInfo

log = logging.getLogger(__name__)

M = TypeVar("M")

ENDPOINT_RETRY_SECONDS = 0.5

# A page of a paged read: 1,000 keys of realistic meta (segment meta is 1-3 KB) is 1-3 MB,
# under gRPC's 4 MiB receive limit. A page of values near MAX_VALUE_BYTES that passes the
# limit is read again with half as many keys (a single value always fits).
PAGE_KEYS = 1000
# etcd's defaults, which the embedded etcd keeps: --max-request-bytes and --max-txn-ops.
MAX_REQUEST_BYTES = 1536 * 1024
MAX_TXN_OPS = 128
# The bound of one value: under etcd's request limit with room for its key and the other
# operations of its transaction.
MAX_VALUE_BYTES = 1024 * 1024
# A paged read whose revision is compacted before its last page starts again at a fresh
# revision, at most this many times (each restart is logged).
WALK_RESTARTS = 3
_REFUSED_CODES = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    version: int  # 1 on creation, +1 per change; 0 means "absent" in a CAS
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class Snapshot:
    """Keys under a prefix, read atomically at `revision`."""

    items: list[KeyValue]
    revision: int


@dataclass(frozen=True)
class Decoded(Generic[M]):
    model: M
    kv: KeyValue


@dataclass(frozen=True)
class ChannelGroup:
    """The segment records of one vchannel of one collection, of both families, as one state
    of a `SegmentCopy` held them, by their live key (`keys.segment`): never changed once
    handed out (a change to the vchannel's segments makes a new group, with a new
    generation)."""

    generation: int
    records: Mapping[str, Decoded[SegmentInfo]]


def kv_of(meta: Any) -> KeyValue:
    """A KeyValue of etcd's `mvccpb.KeyValue` (a range's, or a watch event's `kv`)."""
    return KeyValue(
        key=meta.key.decode(),
        value=bytes(meta.value),
        version=meta.version,
        mod_revision=meta.mod_revision,
        create_revision=meta.create_revision,
        lease=meta.lease,
    )


def _pair_kv(value: bytes, meta: Any) -> KeyValue:
    """A key read by a range of a transaction: its value and etcd3's KVMetadata."""
    return KeyValue(
        key=meta.key.decode(),
        value=bytes(value),
        version=meta.version,
        mod_revision=meta.mod_revision,
        create_revision=meta.create_revision,
        lease=meta.lease_id,
    )


# What a key is written with: raw bytes, or a model / dict that the codec encodes.
Value = bytes | Model | dict[str, Any]


def _as_bytes(key: str, value: Value) -> bytes:
    """The bytes `key` is written with; ValueTooLargeError over MAX_VALUE_BYTES."""
    data = value if isinstance(value, bytes) else encode(value)
    if len(data) > MAX_VALUE_BYTES:
        raise ValueTooLargeError(key, len(data), MAX_VALUE_BYTES)
    return data


def _write_ops(tx: Any, puts: Mapping[str, Value], deletes: Sequence[str]) -> list[Any]:
    """The success branch of a multi-key commit: every put, then every delete."""
    return [tx.put(k, _as_bytes(k, v)) for k, v in puts.items()] + [tx.delete(k) for k in deletes]


def _op_bytes(op: Any) -> int:
    """About what an operation of a transaction adds to etcd's request: its key, range
    end and value (a put's, or a compare's target)."""
    parts = (getattr(op, name, None) for name in ("key", "range_end", "value"))
    return sum(len(p) if isinstance(p, bytes | str) else 8 for p in parts if p is not None)


def _check_bounds(operation: str, branches: Sequence[Sequence[Any]]) -> None:
    """TransactionTooLargeError if a branch has more than MAX_TXN_OPS operations or the
    request more than MAX_REQUEST_BYTES (etcd checks the same, per branch and per request)."""
    ops = max(len(b) for b in branches)
    size = sum(_op_bytes(op) for b in branches for op in b)
    if ops > MAX_TXN_OPS or size > MAX_REQUEST_BYTES:
        named = operation if len(operation) <= 300 else operation[:300] + "..."  # it lists every key
        raise TransactionTooLargeError(named, ops, size, MAX_TXN_OPS, MAX_REQUEST_BYTES)


def is_compacted(exc: BaseException) -> bool:
    """Whether an etcd error says the revision asked for was compacted away."""
    if isinstance(exc, etcd3.exceptions.RevisionCompactedError):
        return True
    return (
        isinstance(exc, grpc.RpcError)
        and hasattr(exc, "code")
        and exc.code() == grpc.StatusCode.OUT_OF_RANGE
        and "compacted" in (exc.details() or "")
    )


def _too_large(exc: BaseException) -> bool:
    """Whether a gRPC error is a response over the client's receive limit."""
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def too_many_ops(exc: BaseException) -> bool:
    """Whether etcd refused a transaction for holding more operations than its
    --max-txn-ops (a server configured below etcd's default of MAX_TXN_OPS)."""
    cause = exc.__cause__ if isinstance(exc, MetaError) else exc
    return (
        isinstance(cause, grpc.RpcError)
        and cause.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "too many operations" in (cause.details() or "")
    )


def _range_end(prefix: str) -> bytes:
    return bytes(etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix)))


@dataclass(frozen=True)
class Fence:
    """A leader's term: its election key as created when it won (`create_revision`). A
    write fenced by it commits only while that key still exists with that create revision,
    so a deposed leader still in the middle of a step writes nothing."""

    key: str
    create_revision: int


class SegmentCopy(Protocol):
    """Segment meta held in memory, as fresh as etcd (`meta.segment_cache.SegmentCache`)."""

    loads: int  # the loads of the prefixes so far (the first, then each after a compaction)

    def snapshot(self, prefix: str) -> Snapshot | None:
        """The keys under `prefix` in key order, or None when the copy cannot prove it is
        current (the caller reads etcd)."""

    def models(self, items: Sequence[KeyValue], skip_malformed: bool) -> list[Decoded[SegmentInfo]]:
        """`items` decoded (each version once)."""

    def decoded(
        self, prefix: str, skip_malformed: bool, live_only: bool = False
    ) -> list[Decoded[SegmentInfo]] | None:
        """`snapshot(prefix)` decoded, or None as `snapshot` (the list must not be changed);
        `live_only`: without the Dropped records an older version left in the live family."""

    def decoded_many(
        self, prefixes: Sequence[str], skip_malformed: bool, live_only: bool = False
    ) -> list[list[Decoded[SegmentInfo]]] | None:
        """`decoded` of each of `prefixes`, all from one state of the copy, or None."""

    def decoded_at(
        self, prefixes: Sequence[str], skip_malformed: bool
    ) -> tuple[list[list[Decoded[SegmentInfo]]], int] | None:
        """`decoded_many`, and the etcd revision that state of the copy stands at (other
        keys read at it make one snapshot with these), or None."""

    def channel_groups(
        self, collection: int, prefixes: Sequence[str], skip_malformed: bool
    ) -> tuple[dict[str, ChannelGroup], int] | None:
        """The collection's records by vchannel (`prefixes`: its two ranges) and the
        revision that state of the copy stands at, or None."""


class MetaStore:
    """Typed access to etcd: reads with revisions, CAS, lease-guarded transactions.

    `fenced(fence)` gives a view of the same connection whose every write is also
    conditional on the leader's term (coordinator writes: watch infos, leases, segments)."""

    def __init__(self, client: etcd3.MultiEndpointEtcd3Client, endpoints: Sequence[str], keys: Keys):
        self.client = client
        self.endpoints = tuple(endpoints)
        self.keys = keys
        self.malformed_skipped = 0  # values skipped because they did not decode (each is logged)
        self.fence: Fence | None = None
        # What reads received from etcd (ranges, gets and `get_at`): keys, and their key and
        # value bytes. A view made by `fenced` counts on its own.
        self.keys_read = 0
        self.bytes_read = 0
        # Segment meta in memory, where a process keeps it (`vchan datacoord`): listings of
        # segments read it instead of etcd (meta/segments.py). Views made by `fenced` share it.
        self.segment_cache: SegmentCopy | None = None

    def fenced(self, fence: Fence) -> MetaStore:
        """This store (same connection) with every write fenced by `fence`; a refused write
        raises NotLeaderError."""
        view = copy.copy(self)
        view.fence = fence
        return view

    def _fence_compare(self) -> list[Any]:
        if self.fence is None:
            return []
        return [self.client.transactions.create(self.fence.key) == self.fence.create_revision]

    def _check_fence(self) -> None:
        """After a refused transaction: NotLeaderError if the fence is what refused it."""
        if self.fence is None:
            return
        held = self.get(self.fence.key)
        found = None if held is None else held.create_revision
        if found != self.fence.create_revision:
            raise NotLeaderError(self.fence.key, self.fence.create_revision, found)

    def _transaction(
        self, what: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
    ) -> tuple[bool, list[Any]]:
        """One transaction under this writer's fence: `success` if every `compare` (and the
        fence) holds, else `failure`. A refusal the fence caused raises NotLeaderError."""
        _check_bounds(what, (compare, success, failure or []))
        with self._call(what):
            ok, responses = self.client.transaction(
                compare=[*compare, *self._fence_compare()], success=success, failure=failure or []
            )
        if not ok:
            self._check_fence()
        return ok, responses

    def _fenced_ops(self, operation: str, success: list[Any]) -> int:
        """`success` in one transaction under the fence (NotLeaderError if refused)."""
        ok, responses = self._transaction(operation, [], success)
        if not ok:
            raise MetaError(f"{operation} was refused without a visible cause")
        return _txn_revision(responses)

    # --- construction ----------------------------------------------------------------

    @classmethod
    def connect(cls, settings: Settings, endpoints: Sequence[str] | None = None) -> MetaStore:
        endpoints = tuple(endpoints or settings.etcd_endpoints or ())
        if not endpoints:
            raise MetaError("no etcd endpoints: start the embedded stack or set VCHAN_ETCD_ENDPOINTS")
        creds = None
        if settings.etcd_ca_cert:
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(
                settings.etcd_ca_cert, settings.etcd_key, settings.etcd_cert
            )
        eps = []
        for endpoint in endpoints:
            host, _, port = endpoint.removeprefix("http://").removeprefix("https://").rpartition(":")
            eps.append(
                etcd3.Endpoint(
                    host, int(port), secure=creds is not None, creds=creds, time_retry=ENDPOINT_RETRY_SECONDS
                )
            )
        store_ops = f"connect to {','.join(endpoints)}"
        try:
            client = etcd3.MultiEndpointEtcd3Client(
                endpoints=eps,
                timeout=settings.etcd_timeout,
                user=settings.etcd_user,
                password=settings.etcd_password,
                failover=True,
            )
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError, ValueError) as exc:
            refused = access_error(exc, settings, endpoints)
            raise refused or MetaUnavailableError(endpoints, store_ops, error_reason(exc)) from exc
        return cls(client, endpoints, Keys(settings.root))

    def check_access(self, settings: Settings) -> None:
        """Fail now, with what to fix, if this process cannot use its root prefix: a TLS
        handshake that fails, or a user whose role may not read and write `{root}/`.

        One transaction whose compare is never true: etcd checks the permission of every
        operation in both branches, so its put is checked but never applied."""
        key = self.keys.root + "/"
        tx = self.client.transactions
        try:
            self.client.transaction(
                compare=[tx.version(key) < 0], success=[tx.put(key, b"")], failure=[tx.get(key)]
            )
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            refused = access_error(exc, settings, self.endpoints)
            if refused is not None:
                raise refused from exc
            raise MetaUnavailableError(self.endpoints, f"access check of {key}", error_reason(exc)) from exc

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def _call(self, operation: str) -> Iterator[None]:
        try:
            yield
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            if isinstance(exc, etcd3.exceptions.RevisionCompactedError):
                raise
            if isinstance(exc, grpc.RpcError) and exc.code() in _REFUSED_CODES:
                # etcd answered, and said no (unknown lease, bad request, no permission).
                raise MetaError(f"etcd refused {operation}: {error_reason(exc)}") from exc
            raise MetaUnavailableError(self.endpoints, operation, error_reason(exc)) from exc

    # --- reads ----------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        with self._call(f"get {key}"):
            resp = self.client.get_response(key)
        self._count(resp.kvs)
        return kv_of(resp.kvs[0]) if resp.kvs else None

    def _count(self, kvs: Sequence[Any]) -> None:
        self.keys_read += len(kvs)
        self.bytes_read += sum(len(kv.key) + len(kv.value) for kv in kvs)

    def get_at(self, keys: Sequence[str], revision: int | None) -> list[KeyValue | None]:
        """Each of `keys` as etcd held it at `revision` (None: absent then), in order: range
        requests in read-only transactions of at most MAX_TXN_OPS (etcd answers a
        transaction at one revision; each range also names `revision`, so every batch reads
        the same snapshot). A batch whose response passes the receive limit, or that an etcd
        with a lower --max-txn-ops refuses, is asked again in halves. `revision` None: now
        (the first batch's revision, then that one: `get_many`).
        RevisionCompactedError if etcd compacted `revision`."""
        out: list[KeyValue | None] = []
        size = MAX_TXN_OPS
        while len(out) < len(keys):
            batch = keys[len(out) : len(out) + size]
            try:
                resp = self._range_txn(batch, revision or 0)
            except MetaError as exc:
                cause = exc.__cause__
                if cause is not None and is_compacted(cause) and revision is not None:
                    raise RevisionCompactedError(batch[0], revision) from cause
                if len(batch) == 1 or cause is None or not (_too_large(cause) or too_many_ops(exc)):
                    raise
                size = len(batch) // 2
                continue
            revision = revision or int(resp.header.revision)
            for r in resp.responses:
                kvs = r.response_range.kvs
                self._count(kvs)
                out.append(kv_of(kvs[0]) if kvs else None)
        return out

    def get_many(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Each of `keys` now (None: absent), in order, at one revision: one round trip for
        up to MAX_TXN_OPS keys where a get each took one each (`get_at`)."""
        return self.get_at(keys, None)

    def get_models(self, keys: Sequence[str], model: type[M]) -> list[Decoded[M] | None]:
        """`get_many`, each value decoded (a malformed one raises, naming its key)."""
        return [
            None if kv is None else Decoded(decode(kv.key, kv.value, model), kv) for kv in self.get_many(keys)
        ]

    def _range_txn(self, keys: Sequence[str], revision: int) -> Any:
        """One transaction of a range request per key, each at `revision`."""
        ranges = [etcdrpc.RangeRequest(key=k.encode(), revision=revision) for k in keys]
        return self._read_txn(ranges, f"get {len(keys)} keys from {keys[0]} at revision {revision}")

    def _read_txn(self, ranges: Sequence[Any], operation: str) -> Any:
        """One read-only transaction of `ranges` (etcd's RangeRequests), answered at one
        revision. (The client's `transaction` builds its ranges without a revision or limit:
        the request is built here, and a gRPC error goes through the client's handling,
        which marks a failed endpoint.)"""
        ops = [etcdrpc.RequestOp(request_range=r) for r in ranges]
        client = self.client
        with self._call(operation):
            try:
                return client.kvstub.Txn(
                    etcdrpc.TxnRequest(success=ops),
                    client.timeout,
                    credentials=client.call_credentials,
                    metadata=client.metadata,
                )
            except grpc.RpcError as exc:
                client._manage_grpc_errors(exc)  # raises the client's error for it
                raise

    def get_model(self, key: str, model: type[M]) -> Decoded[M] | None:
        kv = self.get(key)
        if kv is None:
            return None
        return Decoded(decode(key, kv.value, model), kv)

    def list_prefix(self, prefix: str, revision: int | None = None, keys_only: bool = False) -> Snapshot:
        """Every key under `prefix` in key order, as one snapshot, read in pages.

        At `revision` if given (RevisionCompactedError if etcd compacted it), else at the
        revision of the first page (a walk that outlives a compaction starts again)."""
        [items], at = self._walk([prefix], revision, keys_only)
        return Snapshot(items, at)

    def list_prefixes(
        self,
        prefixes: Sequence[str],
        keys_only: bool = False,
        revision: int | None = None,
        exact: Sequence[str] = (),
    ) -> list[list[KeyValue]]:
        """The keys under each of `prefixes` (each list in key order), every prefix read in
        pages at the same revision: one snapshot of all of them. `revision`: at that one
        (RevisionCompactedError if etcd compacted it), else at the first page's. `exact`:
        single keys read in the same snapshot (in the first pages' transaction when they
        fit in it), each a list after the prefixes' of its value or none."""
        found, _ = self._walk(prefixes, revision=revision, keys_only=keys_only, exact=exact)
        return found

    def list_prefixes_at(self, prefixes: Sequence[str]) -> tuple[list[list[KeyValue]], int]:
        """`list_prefixes`, and the revision they were read at (to watch from the next)."""
        return self._walk(prefixes)

    def _walk(
        self,
        prefixes: Sequence[str],
        revision: int | None = None,
        keys_only: bool = False,
        exact: Sequence[str] = (),
    ) -> tuple[list[list[KeyValue]], int]:
        """The keys under each prefix at one revision, and that revision (Milvus'
        `WalkWithPrefix`), then each of the `exact` keys at that revision. Without a
        `revision`, the first page's is used; if etcd compacts it before the last page, the
        walk starts again at a fresh one (logged), at most WALK_RESTARTS times."""
        for restart in range(WALK_RESTARTS + 1):
            at = revision
            found: list[list[KeyValue]] = []
            try:
                together = len(prefixes) + len(exact) > 1
                first = self._first_pages(prefixes, at, keys_only, exact) if together else None
                if first is not None:
                    pages, at = first
                for i, prefix in enumerate(prefixes):
                    page, more = pages[i] if first is not None else ([], True)
                    if more:
                        start = page[-1].key.encode() + b"\x00" if page else None
                        if page:
                            failpoint("meta_mid_walk")  # a page read, more to come
                        rest, at = self._walk_prefix(prefix, at, keys_only, start)
                        page = [*page, *rest]
                    found.append(page)
                if first is not None:
                    found += [page for page, _ in pages[len(prefixes) :]]
                elif exact:  # (at None, no prefix: the keys at the first batch's revision)
                    found += [[] if kv is None else [kv] for kv in self.get_at(exact, at)]
            except RevisionCompactedError as exc:
                if revision is not None or restart == WALK_RESTARTS:
                    raise
                log.warning("%s after %s keys: listing again at a fresh revision", exc, sum(map(len, found)))
                continue
            return found, at if at is not None else self.revision()
        raise AssertionError("unreachable: the last restart raises")

    def _first_pages(
        self, prefixes: Sequence[str], revision: int | None, keys_only: bool, exact: Sequence[str] = ()
    ) -> tuple[list[tuple[list[KeyValue], bool]], int] | None:
        """The first page of each of `prefixes` in one read-only transaction (one round trip
        where a small listing of several prefixes took one each), PAGE_KEYS keys between them,
        and the revision etcd answered at: per prefix, its keys and whether it has more; then
        each of the `exact` keys (its value or none, never more). A response over the
        receive limit is asked again with half as many keys a prefix; None (the caller pages
        each prefix alone) when even one key each is too large, or when etcd takes fewer
        operations in a transaction (--max-txn-ops)."""
        if len(prefixes) + len(exact) > MAX_TXN_OPS:
            return None
        limit = max(1, PAGE_KEYS // max(len(prefixes), 1))
        while True:
            ranges = [
                etcdrpc.RangeRequest(
                    key=etcd3.utils.to_bytes(prefix),
                    range_end=_range_end(prefix),
                    limit=limit,
                    revision=revision or 0,
                    keys_only=keys_only,
                )
                for prefix in prefixes
            ]
            ranges += [
                etcdrpc.RangeRequest(
                    key=etcd3.utils.to_bytes(key), revision=revision or 0, keys_only=keys_only
                )
                for key in exact
            ]
            try:
                first = (prefixes or exact)[0]
                resp = self._read_txn(
                    ranges, f"list {len(prefixes)} prefixes and {len(exact)} keys from {first}"
                )
            except MetaError as exc:
                cause = exc.__cause__
                if cause is not None and is_compacted(cause) and revision is not None:
                    raise RevisionCompactedError(first, revision) from cause
                if too_many_ops(exc) or (cause is not None and _too_large(cause) and limit == 1):
                    return None
                if cause is None or not _too_large(cause):
                    raise
                limit //= 2
                log.warning(
                    "first pages of %s prefixes over the receive limit: %s keys a prefix",
                    len(prefixes),
                    limit,
                )
                continue
            pages = []
            for r in resp.responses:
                kvs = r.response_range.kvs
                self._count(kvs)
                pages.append(([kv_of(kv) for kv in kvs], bool(r.response_range.more) and bool(kvs)))
            return pages, int(resp.header.revision) if revision is None else revision

    def _walk_prefix(
        self, prefix: str, revision: int | None, keys_only: bool, start: bytes | None = None
    ) -> tuple[list[KeyValue], int]:
        """One prefix in pages at `revision` (None: the first page's), from `start` (the
        prefix itself if None)."""
        items: list[KeyValue] = []
        start, end = start or etcd3.utils.to_bytes(prefix), _range_end(prefix)
        while True:
            resp = self._page(prefix, start, end, revision, keys_only)
            if revision is None:
                revision = int(resp.header.revision)
            self._count(resp.kvs)
            items.extend(kv_of(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return items, revision
            failpoint("meta_mid_walk")  # a page read, more to come
            start = bytes(resp.kvs[-1].key) + b"\x00"

    def _page(self, prefix: str, start: bytes, end: bytes, revision: int | None, keys_only: bool) -> Any:
        """One range request of at most PAGE_KEYS keys from `start`, in key order; a
        response over gRPC's receive limit is asked again with half as many keys."""
        limit = PAGE_KEYS
        while True:
            try:
                with self._call(f"list {prefix}"):
                    return self.client.get_range_response(
                        start,
                        end,
                        sort_order="ascend",
                        sort_target="key",
                        limit=limit,
                        revision=revision,
                        keys_only=keys_only,
                    )
            except MetaError as exc:
                cause = exc.__cause__
                if cause is not None and is_compacted(cause) and revision is not None:
                    raise RevisionCompactedError(prefix, revision) from cause
                if cause is None or not _too_large(cause) or limit == 1:
                    raise
                limit //= 2
                log.warning("a page of %s over the receive limit: reading %s keys a page", prefix, limit)

    def newest_and_count(self, prefix: str) -> tuple[int, int]:
        """(the highest mod revision, how many keys) under `prefix`, from one range
        request of one key, keys only (etcd counts the whole range): it moves whenever a key
        under it is put or deleted, whatever their number."""
        start = etcd3.utils.to_bytes(prefix)
        with self._call(f"count {prefix}"):
            resp = self.client.get_range_response(
                start,
                etcd3.utils.prefix_range_end(start),
                sort_order="descend",
                sort_target="mod",
                limit=1,
                keys_only=True,
            )
        return (int(resp.kvs[0].mod_revision) if resp.kvs else 0), int(resp.count)

    def list_models(
        self, prefix: str, model: type[M], skip_malformed: bool = False
    ) -> tuple[list[Decoded[M]], int]:
        """Decode every value under a prefix; malformed ones raise, or are logged and skipped."""
        snap = self.list_prefix(prefix)
        return self.decode_models(snap.items, model, skip_malformed), snap.revision

    def decode_models(
        self, items: Sequence[KeyValue], model: type[M], skip_malformed: bool = False
    ) -> list[Decoded[M]]:
        """Decode listed values; malformed ones raise, or are logged and skipped."""
        out: list[Decoded[M]] = []
        for kv in items:
            try:
                out.append(Decoded(decode(kv.key, kv.value, model), kv))
            except MalformedValueError as exc:
                if not skip_malformed:
                    raise
                self.malformed_skipped += 1
                log.error("skipping %s", exc)
        return out

    def revision(self) -> int:
        """The store's current revision."""
        with self._call("status"):
            resp = self.client.get_response(self.keys.root + "/")
        return int(resp.header.revision)

    # --- writes ---------------------------------------------------------------------

    def put(self, key: str, value: Value, lease: int | None = None) -> int:
        if self.fence is not None:
            tx = self.client.transactions
            return self._fenced_ops(f"put {key}", [tx.put(key, _as_bytes(key, value), lease=lease)])
        with self._call(f"put {key}"):
            resp = self.client.put(key, _as_bytes(key, value), lease=lease)
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        if self.fence is not None:
            found = self.get(key) is not None
            self._fenced_ops(f"delete {key}", [self.client.transactions.delete(key)])
            return found
        with self._call(f"delete {key}"):
            return bool(self.client.delete(key))

    def delete_prefix(self, prefix: str) -> None:
        if self.fence is not None:
            end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
            self._fenced_ops(f"delete {prefix}", [self.client.transactions.delete(prefix, range_end=end)])
            return
        with self._call(f"delete {prefix}"):
            self.client.delete_prefix(prefix)

    def cas(
        self,
        key: str,
        expected_version: int,
        value: Value | None,
        lease: int | None = None,
    ) -> int:
        """Compare-version-and-swap: write (or delete, if value is None) only if the key's
        version is still `expected_version` (0: the key must not exist). Returns the new
        revision; raises CasConflictError with the version found otherwise."""
        tx = self.client.transactions
        op = tx.delete(key) if value is None else tx.put(key, _as_bytes(key, value), lease=lease)
        ok, responses = self._transaction(
            f"compare-and-swap {key}", [tx.version(key) == expected_version], [op], [tx.get(key)]
        )
        if not ok:
            found = responses[0][0][1].version if responses and responses[0] else 0
            # (responses hold (value, KVMetadata) pairs for the failure branch's get)
            raise CasConflictError(key, expected_version, found)
        return _txn_revision(responses)

    def swap(
        self,
        key: str,
        expected_version: int,
        value: Value,
        also: Mapping[str, Value] | None = None,
        absent: Sequence[str] = (),
    ) -> KeyValue:
        """`cas` of a put that returns the key as written (its version, revisions and
        value), read in the same transaction; `also` is put with it. Each key of `absent`
        must not exist either (CasConflictError naming `key` and its version otherwise)."""
        tx = self.client.transactions
        compare = [tx.version(k) == 0 for k in absent]
        return self._swap_and_read(
            f"compare-and-swap {key}",
            key,
            expected_version,
            compare,
            tx.get(key),
            {key: value, **(also or {})},
        )

    def move(
        self, key: str, expected_version: int, to: str, value: Value, deletes: Sequence[str] = ()
    ) -> KeyValue:
        """`key` deleted (with `deletes`) and `value` put at `to` in one transaction, only
        if `key` still has `expected_version`; returns `to` as written, read in the same
        transaction. CasConflictError naming `key` and the version found otherwise."""
        tx = self.client.transactions
        return self._swap_and_read(
            f"move {key} to {to}", key, expected_version, [], tx.get(to), {to: value}, [key, *deletes]
        )

    def _swap_and_read(
        self,
        what: str,
        key: str,
        expected_version: int,
        compare: list[Any],
        read: Any,
        puts: Mapping[str, Value],
        deletes: Sequence[str] = (),
    ) -> KeyValue:
        """`puts` and `deletes` if `key` has `expected_version` (and `compare` holds), and
        `read` in the same transaction: the key it reads as written."""
        tx = self.client.transactions
        ok, responses = self._transaction(
            what,
            [tx.version(key) == expected_version, *compare],
            [*_write_ops(tx, puts, deletes), read],
            [tx.get(key)],
        )
        found = [_range_kv(r) for r in responses if isinstance(r, list)]
        if not ok:
            raise CasConflictError(key, expected_version, found[0].version if found[0] else 0)
        written = found[0]
        if written is None:
            raise MetaError(f"{what} committed, but its read found no key")
        return written

    def try_swap(self, key: str, expected_version: int, value: Value) -> tuple[bool, KeyValue | None]:
        """Compare-version-and-swap in one round trip, for a hot key: (True, None) when
        written; else (False, the key as it is now, None if absent), so the caller can try
        again at once without a read of its own."""
        tx = self.client.transactions
        return self._put_or_get(key, [tx.version(key) == expected_version], value)

    def raise_value(self, key: str, above: bytes, below: bytes, value: Value) -> tuple[bool, KeyValue | None]:
        """Put `value` only if the key holds a value between `above` and `below` (bytes
        compared, both excluded; an absent key holds none), in one round trip: a mark that
        only moves up, which writers raise without conflicting as long as each writes
        above the last. (True, None) when written; else (False, the key as it is now)."""
        tx = self.client.transactions
        return self._put_or_get(key, [tx.value(key) > above, tx.value(key) < below], value)

    def _put_or_get(self, key: str, compare: list[Any], value: Value) -> tuple[bool, KeyValue | None]:
        tx = self.client.transactions
        ok, responses = self._transaction(
            f"compare-and-swap {key}", compare, [tx.put(key, _as_bytes(key, value))], [tx.get(key)]
        )
        if ok:
            return True, None
        return False, _range_kv(responses[0]) if responses else None

    def txn(
        self,
        expect_versions: Mapping[str, int],
        puts: Mapping[str, Value],
        deletes: Sequence[str] = (),
        present: Sequence[str] = (),
    ) -> int | None:
        """Multi-key compare-version-and-swap: every put and delete, only if each key of
        `expect_versions` still has that version (0: absent) and each key of `present`
        exists. Returns the revision of the commit, or None when a key had changed
        (nothing written)."""
        tx = self.client.transactions
        ok, responses = self._transaction(
            f"transaction on {', '.join([*puts, *deletes])}",
            [tx.version(k) == v for k, v in expect_versions.items()] + [tx.version(k) > 0 for k in present],
            _write_ops(tx, puts, deletes),
        )
        return _txn_revision(responses) if ok else None

    def txn_unchanged_since(
        self,
        revision: int,
        prefixes: Sequence[str],
        puts: Mapping[str, Value],
        expect_versions: Mapping[str, int] | None = None,
    ) -> int | None:
        """`txn`, also only if no key under any of `prefixes` was written after `revision`
        (the revision of the listing the caller decided on): optimistic concurrency on a
        range, e.g. "no build of this segment was added since I listed its builds". A key
        deleted meanwhile is not seen. Returns the revision of the commit, or None."""
        tx = self.client.transactions
        compare = [
            tx.mod(p, range_end=etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(p))) < revision + 1
            for p in prefixes
        ]
        compare += [tx.version(k) == v for k, v in (expect_versions or {}).items()]
        ok, responses = self._transaction(
            f"transaction on {', '.join(puts)}", compare, _write_ops(tx, puts, ())
        )
        return _txn_revision(responses) if ok else None

    def guarded_txn(
        self,
        channel: str,
        lease: ChannelLease,
        puts: Mapping[str, Value],
        deletes: Sequence[str] = (),
        expect_versions: Mapping[str, int] | None = None,
    ) -> int:
        """Commit all `puts` and `deletes` in one transaction, only if `channel-lease/{channel}`
        still holds `lease` (every meta write of a channel is guarded by its lease, as in the
        lease design of Milvus' "DataNode removes its dependency on DataCoord")
        and every key of `expect_versions` still has that version (0: absent).

        On a lost lease nothing is written and LeaseLostError says who holds it now; on a
        changed key, CasConflictError names it (the caller re-reads and retries).
        Returns the revision of the commit."""
        lease_key = self.keys.channel_lease(channel)
        expect = dict(expect_versions or {})
        tx = self.client.transactions
        compare = [tx.value(lease_key) == encode(lease)] + [tx.version(k) == v for k, v in expect.items()]
        failure = [tx.get(lease_key)] + [tx.get(k) for k in expect]
        ok, responses = self._transaction(
            f"guarded commit on {channel}", compare, _write_ops(tx, puts, deletes), failure
        )
        if ok:
            return _txn_revision(responses)
        current = responses[0][0][0] if responses and responses[0] else None
        if current != encode(lease):
            found = None
            if current is not None:
                try:
                    found = decode(lease_key, current, ChannelLease).lease_id
                except MalformedValueError:
                    found = -1
            raise LeaseLostError(channel, lease.lease_id, found)
        for (key, version), got in zip(expect.items(), responses[1:], strict=True):
            found_version = got[0][1].version if got else 0
            if found_version != version:
                raise CasConflictError(key, version, found_version)
        raise MetaError(f"guarded commit on {channel} failed without a visible cause")

    def try_lock(
        self, key: str, value: bytes, lease: int, read: str
    ) -> tuple[KeyValue | None, KeyValue | None]:
        """One transaction: if `key` is absent, put `value` attached to `lease` and read
        `read`. Returns (the lock key as created, `read`) on success, (the key as someone
        else holds it, None) otherwise (None, None if it vanished meanwhile)."""
        tx = self.client.transactions
        ok, responses = self._transaction(
            f"lock {key}",
            [tx.version(key) == 0],
            [tx.put(key, value, lease=lease), tx.get(read), tx.get(key)],
            [tx.get(key)],
        )
        ranges = [_range_kv(r) for r in responses if isinstance(r, list)]
        if not ok:
            return ranges[0], None
        return ranges[1], ranges[0]

    def locked_txn(self, lock: KeyValue, puts: Mapping[str, Value], deletes: Sequence[str] = ()) -> bool:
        """Every put and delete in one transaction, only if the key of `lock` (a lock this
        client holds, as `try_lock` created it) is still that one: its create revision is
        the hold's fencing token. False (nothing written) otherwise."""
        tx = self.client.transactions
        ok, _ = self._transaction(
            f"commit under {lock.key}",
            [tx.create(lock.key) == lock.create_revision],
            _write_ops(tx, puts, deletes),
        )
        return bool(ok)

    def read_lease(self, channel: str) -> ChannelLease | None:
        found = self.get_model(self.keys.channel_lease(channel), ChannelLease)
        return None if found is None else found.model

    # --- etcd leases (TTL) -------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        with self._call("grant lease"):
            return int(self.client.lease(max(1, round(ttl))).id)

    def keepalive(self, lease_id: int) -> int:
        """Refresh an etcd lease; returns its remaining TTL (<= 0: expired)."""
        with self._call("keep-alive"):
            responses = list(self.client.refresh_lease(lease_id))
        return int(responses[0].TTL) if responses else 0

    def revoke(self, lease_id: int) -> None:
        with self._call("revoke lease"):
            self.client.revoke_lease(lease_id)

    def compact(self, revision: int) -> None:
        with self._call(f"compact to {revision}"):
            self.client.compact(revision, physical=True)


def _range_kv(pairs: list[Any]) -> KeyValue | None:
    """The one key of a transaction's range read ((value, KVMetadata) pairs), or None."""
    return _pair_kv(*pairs[0]) if pairs else None


def _txn_revision(responses: list[Any]) -> int:
    """Revision of a successful transaction, from the header of its first write."""
    for response in responses:
        for kind in ("response_put", "response_delete_range"):
            if response.HasField(kind):
                return int(getattr(response, kind).header.revision)
    return 0


def access_error(
    exc: BaseException, settings: Settings, endpoints: tuple[str, ...]
) -> MetaAccessError | None:
    """The access problem an etcd error shows (None: it is not one). The multi-endpoint
    client wraps a failed connection in its own error: the gRPC one is its cause."""
    chain = [exc, exc.__cause__, exc.__context__]
    reason = " / ".join(error_reason(e) for e in chain if e is not None)
    user = f"user {settings.etcd_user!r}" if settings.etcd_user else "no user (VCHAN_ETCD_USER unset)"
    if "authentication failed" in reason or "UNAUTHENTICATED" in reason or "user name is empty" in reason:
        return MetaAccessError(
            endpoints,
            f"authentication of {user} failed: {reason}",
            "check VCHAN_ETCD_USER and VCHAN_ETCD_PASSWORD",
        )
    if "PERMISSION_DENIED" in reason:
        return MetaAccessError(
            endpoints,
            f"{user} may not read and write keys under {settings.root}/: {reason}",
            f"grant its role readwrite on the prefix {settings.root}/, or set VCHAN_ROOT to a prefix it may use",
        )
    if "CERTIFICATE_VERIFY_FAILED" in reason or "handshake" in reason.lower():
        return MetaAccessError(
            endpoints,
            f"TLS handshake failed, the server's certificate is not trusted: {reason}",
            f"check that VCHAN_ETCD_CA_CERT ({settings.etcd_ca_cert or 'unset'}) is the CA that signed it",
        )
    return None


def error_reason(exc: BaseException) -> str:
    """A one-line description of an etcd client or gRPC error."""
    if isinstance(exc, grpc.RpcError):
        details = exc.details() if hasattr(exc, "details") else ""
        return f"{exc.code().name}: {details}" if hasattr(exc, "code") else str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
