"""Segment meta held in memory by a `vchan datacoord` process: Milvus' DataCoord `meta.go`,
loaded once in pages and kept current by one etcd watch.

In Milvus the DataCoord is the only writer of segment meta, so its memory is the truth.
Here DataNodes commit their own segments under their channel lease, so the copy follows
etcd instead of owning it; a read of it is still as fresh as a listing of etcd would be:

- at start it reads both segment families (the live one, `meta/segment/`, and the dropped
  one, `meta/dropped/`, see meta/segments.py) in pages at one revision
  (`MetaStore.list_prefixes_at`, Milvus' `WalkWithPrefix`), then watches both from the next
  revision, two watches on one gRPC stream of its own, and applies every put and delete;
- a read first asks etcd for the stream's progress (etcd's `RequestProgress`) and waits
  for the answer, PROGRESS_ROUNDS times in turn: etcd answers with its current revision,
  and the events committed before the request are queued on the stream by then; responses
  arrive in order, so when the answers are seen every change committed before the read
  began has been applied. No value read. Twice: etcd 3.5.1 sends the answer from a second
  queue that can overtake events already queued (fixed upstream in 3.5.8); a second
  answer, asked after the first arrived, comes after them (bench/cache_freshness.py
  counts reads that missed a write just before them);
- a stream that fell behind etcd's compaction (an outage longer than the history etcd
  keeps) loads the prefix again in pages and says so in the log;
- while the stream is down (etcd restarting), or when etcd does not answer the progress
  request in time, `snapshot` returns None and `SegmentMeta` lists etcd itself, in pages,
  as it does without a cache: a stale copy is never acted on.

Values are decoded once per version. The keys are kept sorted with their records decoded
beside them (`decoded`): the segments of one collection or partition are a slice of that
list, not a scan; a changed value is decoded again in its place, and only a segment created
or deleted sorts the keys again. Both families are held (as Milvus' `meta.go` holds Dropped
segments until its GC removes them), so a listing with the Dropped segments is two slices
of one consistent copy (`decoded_many`), not a read of the dropped family from etcd: the
DataCoord's reload, which summarizes them, reads nothing from etcd but the progress answer.

The records are also grouped by collection and vchannel (`channel_groups`), each group a
mapping that is never changed once handed out: a change makes a new one with a new
generation. A reader that derives something from a vchannel's segments (a search's plan:
`query.channel_plans`) keeps it while the group's generation stands, and only the vchannels
that changed are planned again, as Milvus' QueryCoord changes a channel's segment
distribution only when that channel's segments change.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import etcd3.utils
import grpc
from etcd3.etcdrpc import kv_pb2, rpc_pb2_grpc
from etcd3.etcdrpc import rpc_pb2 as pb

from vchan_assets.config import Settings
from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MalformedValueError
from vchan_assets.meta.store import ChannelGroup, Decoded, KeyValue, MetaStore, Snapshot, error_reason, kv_of
from vchan_assets.model import SegmentInfo, SegmentState

log = logging.getLogger(__name__)

# etcd answers a progress request only while every watcher of the server is in sync
# (none catching up): a request that got no answer is sent again after this long.
PROGRESS_RESEND = 0.2
PROGRESS_ROUNDS = 2
MAX_BACKOFF = 2.0


class _Compacted(Exception):
    """The stream's start revision is gone from etcd's history."""


class SegmentCache:
    """Every segment key and value under `store`'s root (both families), in memory,
    following etcd.

    `start()` loads and follows in a thread; `wait_loaded(timeout)` blocks until the first
    load is in; `snapshot(prefix)` is a fresh, consistent listing or None (read etcd).
    Counters: `loads` (the first and each after a compaction), `reconnects`,
    `events_applied`, `progress_timeouts` (reads that fell back to etcd)."""

    def __init__(self, store: MetaStore, fresh_timeout: float | None = None) -> None:
        self.store = store
        self.prefix = store.keys.segment.prefix  # the live family
        # the families held, in key order (the dropped one sorts first)
        self.prefixes = (store.keys.dropped_segment.prefix, self.prefix)
        self.fresh_timeout = store.client.timeout if fresh_timeout is None else fresh_timeout
        self._kvs: dict[str, KeyValue] = {}
        self._sorted: list[str] | None = None  # the keys in order; None: rebuilt at the next read
        self._models: dict[str, Decoded[SegmentInfo]] = {}  # by key, for the KeyValue cached
        self._revision = 0  # every event up to it applied (the resume cursor)
        # `_sorted`'s records, decoded (None: malformed); `_changed`: keys put or deleted
        # since (moved into both at the next read)
        self._aligned: list[Decoded[SegmentInfo] | None] = []
        self._malformed: set[str] = set()  # keys whose record in `_aligned` is None
        # live-family keys whose record is Dropped (an older version left it there)
        self._unmoved: set[str] = set()
        self._changed: set[str] = set()
        # collection -> vchannel -> its records (`channel_groups`), moved with `_aligned`
        self._groups: dict[int, dict[str, ChannelGroup]] = {}
        self._generation = 0  # the newest group's
        self._following = False  # the stream is open and the copy current up to it
        self._created = 0  # watches of the stream etcd confirmed
        self._progress = 0  # progress answers seen
        self._cond = threading.Condition()
        self._asking = threading.Lock()  # one progress request at a time
        self._requests: queue.Queue[Any] | None = None
        self._call: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loads = 0
        self.reconnects = 0
        self.events_applied = 0
        self.progress_timeouts = 0
        self.started_at = 0.0  # time.monotonic() at `start`

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> SegmentCache:
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="segment cache", daemon=True)
        self._thread.start()
        return self

    def wait_loaded(self, timeout: float) -> bool:
        """Whether the copy was loaded and follows etcd within `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._following, timeout)

    def stop(self) -> None:
        self._stop.set()
        self._end_stream()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.store.client.timeout + 1)

    @property
    def revision(self) -> int:
        """Every change up to this revision is in the copy."""
        return self._revision

    def __len__(self) -> int:
        return len(self._kvs)

    # --- reads ----------------------------------------------------------------------

    def snapshot(self, prefix: str) -> Snapshot | None:
        """The keys under `prefix` (within the segment prefix) in key order, with every
        change committed before this call: None when that cannot be proven in
        `fresh_timeout` (the stream is down, etcd slow), and the caller reads etcd."""
        if not self._fresh():
            return None
        with self._cond:
            keys, _ = self._aligned_records()
            first, last = self._bounds(keys, prefix)
            return Snapshot([self._kvs[k] for k in keys[first:last]], self._revision)

    def decoded(
        self, prefix: str, skip_malformed: bool, live_only: bool = False
    ) -> list[Decoded[SegmentInfo]] | None:
        """The records under `prefix` in key order, as fresh as `snapshot` (None as it); a
        malformed value raises naming its key, or is logged, counted and left out
        (`MetaStore.decode_models`' policy). `live_only`: a Dropped record an older version
        left in the live family is left out (no pass over the others when there is none)."""
        found = self.decoded_many([prefix], skip_malformed, live_only)
        return None if found is None else found[0]

    def decoded_many(
        self, prefixes: Sequence[str], skip_malformed: bool, live_only: bool = False
    ) -> list[list[Decoded[SegmentInfo]]] | None:
        """The records under each of `prefixes` (each list in key order), all of one state
        of the copy (a segment being moved from the live family to the dropped one is in
        exactly one of them), as fresh as `snapshot` (None as it); `live_only` as `decoded`."""
        found = self._decoded_state(prefixes, skip_malformed, live_only)
        return None if found is None else found[0]

    def decoded_at(
        self, prefixes: Sequence[str], skip_malformed: bool
    ) -> tuple[list[list[Decoded[SegmentInfo]]], int] | None:
        """`decoded_many`, and the etcd revision that state of the copy stands at: every
        event up to it applied, none after (a reader reads its other keys at it, for one
        snapshot of etcd: `SegmentMeta.list_with`)."""
        return self._decoded_state(prefixes, skip_malformed, live_only=False)

    def channel_groups(
        self, collection: int, prefixes: Sequence[str], skip_malformed: bool
    ) -> tuple[dict[str, ChannelGroup], int] | None:
        """The collection's records by vchannel (its live and dropped records: `prefixes`
        are the collection's two ranges), as fresh as `snapshot` (None as it), and the
        revision that state of the copy stands at. A malformed value under `prefixes`
        raises naming its key, or is logged, counted and left out (`decoded`'s policy). No
        pass over the records: the groups are kept as the copy changes."""
        if not self._fresh():
            return None
        with self._cond:
            revision = self._revision
            self._aligned_records()
            groups = dict(self._groups.get(collection, {}))
            ranges = tuple(prefixes)
            malformed = [self._kvs[k] for k in self._malformed if k.startswith(ranges)]
        if malformed:
            self.store.decode_models(malformed, SegmentInfo, skip_malformed)  # raises, or logs and counts
        return groups, revision

    def _decoded_state(
        self, prefixes: Sequence[str], skip_malformed: bool, live_only: bool
    ) -> tuple[list[list[Decoded[SegmentInfo]]], int] | None:
        if not self._fresh():
            return None
        malformed: list[KeyValue] = []
        with self._cond:
            revision = self._revision
            keys, aligned = self._aligned_records()
            found = []
            for prefix in prefixes:
                first, last = self._bounds(keys, prefix)
                part = aligned[first:last]
                if live_only and self._unmoved:
                    part = [d for d in part if d is None or d.kv.key not in self._unmoved]
                found.append(part)
                if self._malformed:
                    malformed += [self._kvs[keys[i]] for i in range(first, last) if aligned[i] is None]
        if not malformed:
            return found, revision  # type: ignore[return-value]  # (no None in them)
        self.store.decode_models(malformed, SegmentInfo, skip_malformed)  # raises, or logs and counts
        return [[d for d in part if d is not None] for part in found], revision

    def _bounds(self, keys: list[str], prefix: str) -> tuple[int, int]:
        """Where the keys under `prefix` are in `keys` (sorted)."""
        if not prefix.startswith(self.prefixes):
            raise ValueError(f"{prefix} is under none of the cached prefixes {self.prefixes}")
        first = bisect.bisect_left(keys, prefix)
        last = bisect.bisect_left(keys, prefix[:-1] + chr(ord(prefix[-1]) + 1)) if prefix else len(keys)
        return first, last

    def _aligned_records(self) -> tuple[list[str], list[Decoded[SegmentInfo] | None]]:
        """The sorted keys and their records (under `_cond`): built after a load, then each
        key put or deleted since the last read moved into place (a bisection, and a C-level
        insert or delete: no pass over the other segments)."""
        if self._sorted is None or len(self._changed) > len(self._kvs) // 8:
            keys = self._sorted = sorted(self._kvs)
            self._aligned = [self._record(self._kvs[k]) for k in keys]
            self._malformed = {k for k, d in zip(keys, self._aligned, strict=True) if d is None}
            self._unmoved = {k for k, d in zip(keys, self._aligned, strict=True) if self._is_unmoved(k, d)}
            self._changed.clear()
            self._group_all(self._aligned)
            return keys, self._aligned
        keys, aligned = self._sorted, self._aligned
        regroup = _Regroup(self)
        for key in self._changed:
            i = bisect.bisect_left(keys, key)
            held = i < len(keys) and keys[i] == key
            kv = self._kvs.get(key)
            if kv is None:
                if held:
                    regroup.remove(aligned[i])
                    del keys[i], aligned[i]
                self._malformed.discard(key)
                self._unmoved.discard(key)
                continue
            record = self._record(kv)
            if held:
                regroup.remove(aligned[i])
                aligned[i] = record
            else:
                keys.insert(i, key)
                aligned.insert(i, record)
            regroup.add(record)
            if record is None:
                self._malformed.add(key)
            else:
                self._malformed.discard(key)
            if self._is_unmoved(key, record):
                self._unmoved.add(key)
            else:
                self._unmoved.discard(key)
        self._changed.clear()
        regroup.publish()
        return keys, aligned

    def _group_all(self, aligned: Sequence[Decoded[SegmentInfo] | None]) -> None:
        """Every group made again from the records (after a load)."""
        self._generation += 1
        found: dict[int, dict[str, dict[str, Decoded[SegmentInfo]]]] = {}
        for d in aligned:
            if d is not None:
                m = d.model
                found.setdefault(m.collection_id, {}).setdefault(m.vchannel, {})[self.live_key(m)] = d
        self._groups = {
            c: {v: ChannelGroup(self._generation, records) for v, records in channels.items()}
            for c, channels in found.items()
        }

    def live_key(self, seg: SegmentInfo) -> str:
        """The segment's key in the live family (a group's key for either family's record)."""
        return self.store.keys.segment(seg.collection_id, seg.partition_id, seg.id)

    def _is_unmoved(self, key: str, record: Decoded[SegmentInfo] | None) -> bool:
        """A Dropped record in the live family (left there by an older version)."""
        return (
            record is not None and record.model.state is SegmentState.DROPPED and key.startswith(self.prefix)
        )

    def _record(self, kv: KeyValue) -> Decoded[SegmentInfo] | None:
        """`kv` decoded (once per version), None if malformed."""
        found = self._models.get(kv.key)
        if found is not None and found.kv is kv:
            return found
        try:
            found = Decoded(decode(kv.key, kv.value, SegmentInfo), kv)
        except MalformedValueError:
            return None
        self._models[kv.key] = found
        return found

    def models(self, items: Sequence[KeyValue], skip_malformed: bool) -> list[Decoded[SegmentInfo]]:
        """`items` (from `snapshot`) decoded, each version once; the values not decoded yet
        go through `MetaStore.decode_models` (its policy for a malformed value: raise naming
        the key, or log, count and skip)."""
        memo = self._models
        found: list[Decoded[SegmentInfo] | None] = []
        missing: list[KeyValue] = []
        for kv in items:
            d = memo.get(kv.key)
            if d is None or d.kv is not kv:
                missing.append(kv)
                d = None
            found.append(d)
        if not missing:
            return found  # type: ignore[return-value]  # (no None left)
        fresh = {d.kv.key: d for d in self.store.decode_models(missing, SegmentInfo, skip_malformed)}
        memo.update(fresh)
        return [
            d if d is not None else fresh[kv.key]
            for kv, d in zip(items, found, strict=True)
            if d is not None or kv.key in fresh
        ]

    def _fresh(self) -> bool:
        """Ask etcd for the stream's progress and wait for the answer, PROGRESS_ROUNDS times
        in turn (see the module)."""
        deadline = time.monotonic() + self.fresh_timeout
        with self._asking:
            for _ in range(PROGRESS_ROUNDS):
                if not self._progress_answered(deadline):
                    return False
        return True

    def _progress_answered(self, deadline: float) -> bool:
        with self._cond:
            if not self._following:
                return False
            seen = self._progress
        while (left := deadline - time.monotonic()) > 0:
            requests = self._requests
            if requests is None:
                return False
            requests.put(pb.WatchRequest(progress_request=pb.WatchProgressRequest()))
            with self._cond:
                self._cond.wait_for(
                    lambda: self._progress > seen or not self._following, min(PROGRESS_RESEND, left)
                )
                if self._progress > seen:
                    return True
                if not self._following:
                    return False
        self.progress_timeouts += 1
        log.warning(
            "segment cache: etcd did not answer a progress request in %.1fs: reading etcd", self.fresh_timeout
        )
        return False

    # --- the thread -----------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.1
        load = True
        while not self._stop.is_set():
            try:
                if load:
                    self._load()
                    load = False
                self._follow()
                backoff = 0.1
            except _Compacted:
                log.warning(
                    "segment cache fell behind etcd's compaction (revision %d is gone): loading %s again in pages",
                    self._revision + 1,
                    " and ".join(self.prefixes),
                )
                load = True
            except Exception as exc:  # etcd down or restarting: reads go to etcd meanwhile
                if self._stop.is_set():
                    break
                self.reconnects += 1
                log.warning(
                    "segment cache: watch of %s interrupted (%s); again in %.1fs",
                    " and ".join(self.prefixes),
                    error_reason(exc),
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            finally:
                with self._cond:
                    self._following = False
                    self._cond.notify_all()

    def _load(self) -> None:
        started = time.monotonic()
        families, revision = self.store.list_prefixes_at(self.prefixes)  # in pages, at one revision
        with self._cond:
            self._kvs = {kv.key: kv for items in families for kv in items}
            self._sorted = None
            self._models = {k: d for k, d in self._models.items() if self._kvs.get(k) is d.kv}
            self._revision = revision
        self.loads += 1
        dropped, live = map(len, families)
        log.info(
            "segment cache: %d segment keys and %d dropped ones loaded at revision %d in %.2fs",
            live,
            dropped,
            revision,
            time.monotonic() - started,
        )

    def _follow(self) -> None:
        """Watch from the cursor until stopped or the stream breaks."""
        requests: queue.Queue[Any] = queue.Queue()
        for prefix in self.prefixes:  # one watch per family on the stream, from one revision
            create = pb.WatchCreateRequest(
                key=etcd3.utils.to_bytes(prefix),
                range_end=etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix)),
                start_revision=self._revision + 1,
            )
            requests.put(pb.WatchRequest(create_request=create))
        self._created = 0
        client = self.store.client
        stub = rpc_pb2_grpc.WatchStub(client.channel)
        call = stub.Watch(_drain(requests), credentials=client.call_credentials, metadata=client.metadata)
        self._requests, self._call = requests, call
        if self._stop.is_set():
            self._end_stream()
        try:
            for response in call:
                self._receive(response)
        except grpc.RpcError:
            if self._stop.is_set():
                return
            raise
        finally:
            self._requests = None
        if not self._stop.is_set():
            raise ConnectionError("the watch stream ended")

    def _receive(self, response: Any) -> None:
        if response.compact_revision:
            raise _Compacted()
        if response.created:  # following once every family's watch is in (a progress
            # answer then covers both: etcd sends it when every watch of the stream is synced)
            with self._cond:
                self._created += 1
                self._following = self._created == len(self.prefixes)
                self._cond.notify_all()
            return
        if response.canceled:
            raise ConnectionError(f"etcd cancelled the watch: {response.cancel_reason}")
        if not response.events:  # etcd's answer to a progress request (watch id -1)
            with self._cond:
                self._revision = max(self._revision, int(response.header.revision))
                self._progress += 1
                self._cond.notify_all()
            return
        with self._cond:
            for event in response.events:
                self._apply(event)
            self._cond.notify_all()

    def _apply(self, event: Any) -> None:
        kv = event.kv
        key = kv.key.decode()
        if event.type == kv_pb2.Event.DELETE:
            self._kvs.pop(key, None)
            self._models.pop(key, None)
        else:
            self._kvs[key] = kv_of(kv)
        self._changed.add(key)
        self._revision = max(self._revision, int(kv.mod_revision))
        self.events_applied += 1

    def _end_stream(self) -> None:
        requests, call = self._requests, self._call
        if requests is not None:
            requests.put(None)
        if call is not None:
            call.cancel()


class _Regroup:
    """The groups one read's changes touch, each copied once and published together with a
    new generation (the groups handed out before are left as they were)."""

    def __init__(self, cache: SegmentCache) -> None:
        self.cache = cache
        self.touched: dict[tuple[int, str], dict[str, Decoded[SegmentInfo]]] = {}

    def _records(self, seg: SegmentInfo) -> dict[str, Decoded[SegmentInfo]]:
        where = (seg.collection_id, seg.vchannel)
        records = self.touched.get(where)
        if records is None:
            held = self.cache._groups.get(seg.collection_id, {}).get(seg.vchannel)
            records = self.touched[where] = dict(held.records) if held is not None else {}
        return records

    def remove(self, d: Decoded[SegmentInfo] | None) -> None:
        if d is None:
            return
        records = self._records(d.model)
        key = self.cache.live_key(d.model)
        if records.get(key) is d:  # (a segment moved between families: its other record stays)
            del records[key]

    def add(self, d: Decoded[SegmentInfo] | None) -> None:
        if d is not None:
            self._records(d.model)[self.cache.live_key(d.model)] = d

    def publish(self) -> None:
        if not self.touched:
            return
        cache = self.cache
        cache._generation += 1
        for (collection, vchannel), records in self.touched.items():
            channels = cache._groups.setdefault(collection, {})
            if records:
                channels[vchannel] = ChannelGroup(cache._generation, records)
            else:
                channels.pop(vchannel, None)
                if not channels:
                    del cache._groups[collection]


def _drain(requests: queue.Queue[Any]) -> Iterator[Any]:
    while (request := requests.get()) is not None:
        yield request


_shared_lock = threading.Lock()
_shared: tuple[tuple[tuple[str, ...], str], SegmentCache] | None = None


def shared_segment_cache(settings: Settings, endpoints: Sequence[str]) -> SegmentCache:
    """The process's segment cache of `endpoints` and `settings.root`, started (on a
    connection of its own) at the first call: for a long-lived process whose DataCoord runs
    as a series of short calls, Dagster's code server evaluating the DataCoord sensor each
    second. Until its first load is in, listings through it read etcd. One per process: a
    call for another etcd or root stops the one before (tests open many roots in one
    process)."""
    global _shared
    key = (tuple(endpoints), settings.root)
    with _shared_lock:
        if _shared is not None and _shared[0] != key:
            _shared[1].stop()
            _shared[1].store.close()
            _shared = None
        if _shared is None:
            _shared = (key, SegmentCache(MetaStore.connect(settings, endpoints)).start())
        return _shared[1]


def stop_shared_segment_cache() -> None:
    """Stop the process's shared segment cache, if one was started (before its etcd goes)."""
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared[1].stop()
            _shared[1].store.close()
            _shared = None
