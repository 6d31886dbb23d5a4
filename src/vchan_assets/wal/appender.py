"""Appending to a vchannel from any number of processes (docs/multi-writer.md).

One append of a batch with inserts first writes their columns as a data file named by
the batch id (`WalWriter.write_data`: no lock, it depends on nothing the head decides),
then, under the channel's append lock in etcd (`meta.channel_head`):

1. acquire the lock and read the channel head (next offset, last timestamp, open segments);
2. `build(held)` makes the batch's system columns: timestamps above the head's last,
   segment IDs from the head's open segments (opening new ones commits them with the head
   first);
3. publish the (small) log file at the head's next offset with an exclusive create;
4. commit the new head and release the lock, in one transaction.

What a killed writer leaves: before 3, nothing but a lock that its lease expiry frees
and maybe a data file no log file names (garbage, `lifecycle.gc`)
(the next holder gets the same offset: no hole); after 3, a whole file the head does not
count yet: the next holder's exclusive create fails at that offset, so it adopts the
file (offsets, last timestamp, rows per segment) and appends after it. A file is never
written twice: every attempt of one batch carries the same batch id in its footer, and a
retry first looks for a file with its id where it tried before.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import pyarrow as pa

from vchan_assets.failpoints import failpoint
from vchan_assets.meta.channel_head import (
    AppendLockLostError,
    AppendLockTimeoutError,
    ChannelHeads,
    HeldChannel,
)
from vchan_assets.meta.errors import MetaError, MetaUnavailableError
from vchan_assets.meta.retry import retry_transient
from vchan_assets.model import ChannelHead
from vchan_assets.storage import StorageError
from vchan_assets.wal.writer import DataFile, LogConflictError, WalWriter, WrittenBatch

log = logging.getLogger(__name__)

R = TypeVar("R")

# What a retry waits out: etcd or storage unavailable, or a lock lost to a long pause.
TRANSIENT: tuple[type[BaseException], ...] = (MetaUnavailableError, StorageError, AppendLockLostError)


@dataclass(frozen=True)
class Built(Generic[R]):
    """A batch ready to publish: the rows, the head after them (its offset is set by the
    appender), what the caller reports, and work to do once the batch is in the log."""

    table: pa.Table
    head: ChannelHead
    result: R
    after: Callable[[], None] | None = None


@dataclass
class Timing:
    """Count and total seconds of something timed (for benchmarks and logs)."""

    count: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds


@dataclass(frozen=True)
class Prepared:
    """What a batch has before it takes the lock: its id (every attempt's file carries
    it) and, for inserts, its data file."""

    batch_id: str
    data: DataFile | None = None


@dataclass(frozen=True)
class Appended(Generic[R]):
    first_offset: int
    last_offset: int
    result: R


class ChannelAppender:
    """Appends batches to one vchannel under its append lock; see the module docstring."""

    def __init__(
        self,
        heads: ChannelHeads,
        writer: WalWriter,
        retry_timeout: float,
        lock: threading.RLock | None = None,
    ) -> None:
        self.heads = heads
        self.writer = writer
        self.vchannel = writer.vchannel
        self.retry_timeout = retry_timeout
        self.lock = lock or threading.RLock()  # one append at a time per channel in this process
        self.adopted = 0  # files of dead writers taken into the head (metric)
        # metrics: the acquire call (its round trip and any wait for another holder), and
        # the critical section from the lock taken to its release
        self.acquiring = Timing()
        self.held = Timing()

    def prepare(self, rows: pa.Table | None = None) -> Prepared:
        """A batch id and, given inserted `rows` (`WalWriter.data_schema`), their data file,
        written now, outside the lock (retried while storage is unavailable)."""
        batch_id = uuid.uuid4().hex
        if rows is None:
            return Prepared(batch_id)
        data = retry_transient(
            f"write a data file of {self.vchannel}",
            lambda: self.writer.write_data(rows, batch_id),
            self.retry_timeout,
            (StorageError,),
        )
        failpoint("after_wal_data")
        return Prepared(batch_id, data)

    def append(
        self,
        build: Callable[[HeldChannel], Built[R]],
        only_if_empty: bool = False,
        block: bool = True,
        prepared: Prepared | None = None,
    ) -> Appended[R] | None:
        """Append the batch `build` makes; retried (same batch id) while etcd or storage is
        unavailable, up to the retry timeout. None if `only_if_empty` and the log is not,
        or if not `block` and another writer holds the lock (nothing was done, `prepared`
        can be appended later). With a `prepared` data file, `build` makes the system
        columns only, the inserts first (log format 2)."""
        prepared = prepared or Prepared(uuid.uuid4().hex)
        batch_id, data = prepared.batch_id, prepared.data
        tried: dict[int, R] = {}  # offsets this batch was published at (maybe) -> its result

        def attempt() -> Appended[R] | None:
            mine = self._find_mine(batch_id, tried)
            if mine is not None:
                return mine
            with self.lock:
                started = time.perf_counter()
                try:
                    held = self.heads.acquire(self.vchannel, wait=None if block else 0)
                except AppendLockTimeoutError:
                    if block:
                        raise
                    return None  # busy: the caller appends elsewhere first
                taken = time.perf_counter()
                self.acquiring.add(taken - started)
                try:
                    done = self._append_held(held, build, only_if_empty, batch_id, tried, data)
                finally:
                    self.heads.release(held)
                    self.held.add(time.perf_counter() - taken)
            if done is None:
                return None
            appended, after = done
            if after is not None:
                after()
            return appended

        return retry_transient(f"append to {self.vchannel}", attempt, self.retry_timeout, TRANSIENT)

    def _append_held(
        self,
        held: HeldChannel,
        build: Callable[[HeldChannel], Built[R]],
        only_if_empty: bool,
        batch_id: str,
        tried: dict[int, R],
        data: DataFile | None,
    ) -> tuple[Appended[R], Callable[[], None] | None] | None:
        """Steps 2-4 under the lock; returns what was appended and the batch's `after`
        (None if its head commit failed: the head still lists what it took off)."""
        self._load_offset(held)
        while True:
            if only_if_empty and held.head.next_offset > 0:
                return None
            built = build(held)
            first = held.head.next_offset
            held.check()
            failpoint("before_wal_publish")
            tried[first] = built.result
            try:
                _, last_ts = self.writer.write_at(built.table, first, held.head.last_ts, batch_id, data)
            except LogConflictError:
                self._adopt(held)  # a file the head does not count: a dead writer's
                continue
            failpoint("after_wal_publish")
            last = first + built.table.num_rows - 1
            head = replace(built.head, next_offset=last + 1, last_ts=max(built.head.last_ts, last_ts))
            committed = self._commit(held, head)
            return Appended(first, last, built.result), built.after if committed else None

    # --- internals -----------------------------------------------------------------------------

    def _commit(self, held: HeldChannel, head: ChannelHead) -> bool:
        """The batch is in the log once its file is: a commit that fails leaves the head
        behind (the next holder adopts the file), and `after` is skipped, since the head
        still lists what the batch took off it."""
        try:
            held.commit(head, release=True)
        except MetaError as exc:
            log.warning(
                "%s: batch published, head not advanced (%s); the next writer adopts it", self.vchannel, exc
            )
            return False
        return True

    def _find_mine(self, batch_id: str, tried: dict[int, R]) -> Appended[R] | None:
        """After a failed attempt: the file this batch may have been published as."""
        for first, result in tried.items():
            found = self.writer.written_at(first)
            if found is not None and found.batch_id == batch_id:
                log.info(
                    "%s: batch %s was published at %d before the failure", self.vchannel, batch_id, first
                )
                return Appended(first, first + found.count - 1, result)
        return None

    def _load_offset(self, held: HeldChannel) -> None:
        """A head of unknown offset (a new channel, or one written before heads existed)
        takes the end of the log in storage."""
        if held.head.next_offset >= 0:
            return
        last = self.writer.tail()
        held.head = replace(held.head, next_offset=last[0], last_ts=max(held.head.last_ts, last[1]))

    def _adopt(self, held: HeldChannel) -> None:
        """Count every file past the head's offset into the head: offsets, last timestamp,
        and rows per open segment."""
        head = held.head
        while (found := self.writer.written_at(head.next_offset)) is not None:
            head = _counted(head, found)
            self.adopted += 1
            log.warning(
                "%s: adopted the file at offset %d (%d messages) that its writer did not commit",
                self.vchannel,
                found.first_offset,
                found.count,
            )
        held.head = head


def _counted(head: ChannelHead, found: WrittenBatch) -> ChannelHead:
    rows = dict(found.segment_rows)
    segments = tuple(
        replace(s, allocated=s.allocated + rows[s.segment_id]) if s.segment_id in rows else s
        for s in head.open_segments
    )
    return replace(
        head,
        next_offset=found.first_offset + found.count,
        last_ts=max(head.last_ts, found.last_timestamp),
        open_segments=segments,
    )
