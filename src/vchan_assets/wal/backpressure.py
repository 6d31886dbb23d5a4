"""Write back-pressure: a vchannel whose checkpoint lags its log head too far slows its
writers, then refuses their inserts and deletes (Milvus' DML quota on time-tick delay).

A channel's lag is what its DataNode has not synced yet: the log after the channel
checkpoint (or after the collection's start position, before the first sync), in bytes
(its files, data files included: what the log holds on disk for it) and in seconds (the
age of its oldest unsynced message). Against `VCHAN_WRITE_LAG_LIMIT_MB` and
`VCHAN_WRITE_LAG_LIMIT_SECONDS` (0: that limit is off), the larger of the two ratios:

- below `SLOW_FROM` (half of a limit) a write goes at once;
- from there to the limit, each insert or delete call first sleeps, in proportion, up to
  `MAX_DELAY` seconds at the limit: producers slow down before they are stopped;
- past a limit, the call raises `WriteLagExceededError` naming the channel and its lag;
  nothing of it was written. Flushes, time ticks and DDL go on: a flush is how a DataNode
  catches up, and it must not be refused.

Writes resume by themselves: the lag is read again at most every `REFRESH_SECONDS` per
channel (one etcd get of the checkpoint, and the footers of the log files written since
the last reading; a `WalReader` caches the older ones), never once per insert. Between two
readings the producer adds what it writes itself (`wrote`), so a fast producer does not run
past the limit on a stale reading. A reading that fails (etcd or storage unavailable, a
damaged log file) keeps the last one: back-pressure never refuses a write it cannot measure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from vchan_assets.config import Settings
from vchan_assets.errors import DeclaredError
from vchan_assets.meta.errors import MetaUnavailableError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, physical_ms
from vchan_assets.storage import Storage, StorageError
from vchan_assets.wal.format import LogError
from vchan_assets.wal.reader import WalReader

log = logging.getLogger(__name__)

SLOW_FROM = 0.5  # share of a limit from which writes slow down
MAX_DELAY = 1.0  # seconds a write call sleeps at the limit
REFRESH_SECONDS = 1.0  # a channel's lag is read again at most this often
MB = 1 << 20


class WriteLagExceededError(DeclaredError, LogError):
    """A vchannel's checkpoint lags its log head by more than the write lag limit: inserts
    and deletes are refused until its DataNode catches up."""

    vchannel: str
    lag_mb: float
    lag_seconds: float
    limit: str

    def __str__(self) -> str:
        return (
            f"channel {self.vchannel}: writes refused, its checkpoint lags the log by "
            f"{self.lag_mb:.1f} MB and {self.lag_seconds:.0f} s (limit {self.limit}); nothing was "
            f"written. Its DataNode is stopped or behind: writes resume once it catches up"
        )


@dataclass(frozen=True)
class ChannelLag:
    """What a channel's DataNode has not synced yet, as read at `read_at` (monotonic)."""

    vchannel: str
    bytes: int
    seconds: float
    read_at: float


def channel_lag(
    store: MetaStore, reader: WalReader, collection: CollectionInfo, now: float | None = None
) -> ChannelLag:
    """The lag of `reader`'s channel now: the log after its checkpoint (or after the
    collection's start position when it has none)."""
    vchannel = reader.vchannel
    found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    if found is not None:
        after = found.model.offset
    else:
        starts = [p.offset for p in collection.start_positions if p.channel == vchannel]
        after = starts[0] if starts else -1
    backlog = reader.backlog(after)
    wall = time.time() if now is None else now
    age = 0.0
    if backlog.messages and backlog.oldest_timestamp is not None:
        age = max(0.0, wall - physical_ms(backlog.oldest_timestamp) / 1000)
    return ChannelLag(vchannel, backlog.size_bytes if backlog.messages else 0, age, time.monotonic())


class WriteLimiter:
    """The producer's side of back-pressure: `admit(collection, vchannels)` before an insert
    or delete sleeps or raises as the module docstring says. Metrics: `slowed` (calls that
    slept), `slept_seconds`, `refused`."""

    def __init__(
        self,
        store: MetaStore,
        storage: Storage,
        settings: Settings,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store, self.storage = store, storage
        self.limit_bytes = settings.write_lag_limit_mb * MB
        self.limit_seconds = settings.write_lag_limit_seconds
        self.sleep = sleep
        self._lags: dict[str, ChannelLag] = {}
        self._since: dict[str, int] = {}  # bytes this producer wrote since the last reading
        self._readers: dict[str, WalReader] = {}
        self._lock = threading.Lock()
        self.slowed = 0
        self.slept_seconds = 0.0
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0 or self.limit_seconds > 0

    def describe_limit(self) -> str:
        parts = []
        if self.limit_bytes > 0:
            parts.append(f"VCHAN_WRITE_LAG_LIMIT_MB={self.limit_bytes / MB:g}")
        if self.limit_seconds > 0:
            parts.append(f"VCHAN_WRITE_LAG_LIMIT_SECONDS={self.limit_seconds:g}")
        return ", ".join(parts)

    def ratio(self, lag: ChannelLag) -> float:
        """The lag as a share of the nearest limit (1: at the limit)."""
        ratios = [0.0]
        if self.limit_bytes > 0:
            ratios.append(lag.bytes / self.limit_bytes)
        if self.limit_seconds > 0:
            ratios.append(lag.seconds / self.limit_seconds)
        return max(ratios)

    def lag(self, collection: CollectionInfo, vchannel: str) -> ChannelLag:
        """The channel's lag, read again if the cached one is older than REFRESH_SECONDS."""
        with self._lock:
            cached = self._lags.get(vchannel)
            if cached is not None and time.monotonic() - cached.read_at < REFRESH_SECONDS:
                return replace(cached, bytes=cached.bytes + self._since.get(vchannel, 0))
            reader = self._readers.get(vchannel)
            if reader is None or reader.collection.id != collection.id:
                reader = self._readers[vchannel] = WalReader(self.storage, vchannel, collection)
            try:
                lag = channel_lag(self.store, reader, collection)
            except (MetaUnavailableError, StorageError, LogError) as exc:
                # Not a reason to refuse a write: the append retries etcd and storage itself,
                # and a damaged log is the sync's to report. Keep the last reading meanwhile.
                log.warning("write lag of %s unknown (%s): keeping the last reading", vchannel, exc)
                last = cached or ChannelLag(vchannel, 0, 0.0, 0.0)
                lag = replace(last, bytes=last.bytes + self._since.get(vchannel, 0))
            self._lags[vchannel] = replace(lag, read_at=time.monotonic())
            self._since[vchannel] = 0
            return lag

    def wrote(self, vchannel: str, nbytes: int) -> None:
        """This producer is writing about `nbytes` to `vchannel`: counted until the next reading."""
        with self._lock:
            self._since[vchannel] = self._since.get(vchannel, 0) + nbytes

    def admit(self, collection: CollectionInfo, vchannels: list[str]) -> None:
        """Sleep in proportion to the worst lag of `vchannels` past SLOW_FROM, or raise
        WriteLagExceededError for the first one past its limit."""
        if not self.enabled:
            return
        worst = 0.0
        for vchannel in vchannels:
            lag = self.lag(collection, vchannel)
            ratio = self.ratio(lag)
            if ratio > 1.0:
                self.refused += 1
                raise WriteLagExceededError(vchannel, lag.bytes / MB, lag.seconds, self.describe_limit())
            worst = max(worst, ratio)
        if worst > SLOW_FROM:
            delay = MAX_DELAY * (worst - SLOW_FROM) / (1 - SLOW_FROM)
            self.slowed += 1
            self.slept_seconds += delay
            log.info(
                "write lag at %.0f%% of the limit on %s: slowing by %.2fs", worst * 100, vchannels, delay
            )
            self.sleep(delay)
