"""Reads at a timestamp racing the whole lifecycle, with real processes: a `vchan datanode`
syncs every half second, `vchan datacoord` sorts each flush, runs L0 and mix compaction and
garbage-collects every second with a time-travel window of a few seconds (so dropped
segments' files really go during the test), and one DataCoord is SIGKILLed at a commit step
of an L0 or mix compaction and replaced. Meanwhile a producer thread inserts and deletes,
recording the timestamp of every acknowledged message, and a reader thread reads at T over
and over: at the last acknowledged timestamp, at timestamps a few seconds back (just at and
just before an acknowledged message), and at "now".

Every read at T returns exactly the rows acknowledged at or before T, without those whose
delete was acknowledged at or before T: each pk once, with its value. A read at "now"
returns, on each vchannel, the state after a prefix of that vchannel's messages: at least
everything acknowledged before the read began (its T is above every timestamp issued so
far), and no message half."""

from __future__ import annotations

import random
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.lifecycle.plans import CompactionPlan, CompactionType, PlanState, list_plans
from vchan_assets.lifecycle.step import unsorted_segments
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, compose_ts, physical_ms
from vchan_assets.query.view import collection_segments
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import SCHEMA, Cluster, Role, all_synced, checkpoint_of, create_collections
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import ChannelAppend, Producer, generate_rows

from .helpers import MARGIN, TIME_TRAVEL, race_settings


@dataclass
class Acked:
    """The producer's acknowledged messages, in order: each pk's message timestamp (its
    vchannel's batch), and each operation's timestamp per vchannel."""

    channels: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    inserted: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # pk, ts, n
    deleted: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # pk, ts
    ops: list[tuple[float, dict[int, int]]] = field(default_factory=list)  # (acked at, channel -> ts)

    def record(
        self,
        pks: np.ndarray,
        appended: dict[str, ChannelAppend],
        vchannels: list[str],
        n: np.ndarray | None = None,  # the inserted rows' values; None: a delete
    ) -> None:
        # A batch's messages carry the timestamp just below its closing time tick.
        per_channel = {vchannels.index(v): a.timestamp - 1 for v, a in appended.items()}
        ts = np.array([per_channel[int(pk) % self.channels] for pk in pks], dtype=np.int64)
        with self.lock:
            if n is None:
                self.deleted.append((pks, ts))
            else:
                self.inserted.append((pks, ts, n))
            self.ops.append((time.time(), per_channel))

    def snapshot(self) -> tuple[int, int]:
        """(operations acknowledged so far, the last acknowledged timestamp)."""
        with self.lock:
            last = max((max(ts.values()) for _, ts in self.ops[-1:]), default=0)
            return len(self.ops), last

    def state_at(self, ts: int, channel: int | None = None) -> pa.Table:
        """pk and n of the rows acknowledged at or before `ts` and not deleted at or before
        it (on one vchannel if given), sorted by pk."""
        with self.lock:
            inserted, deleted = list(self.inserted), list(self.deleted)
        pk = np.concatenate([i[0] for i in inserted])
        its = np.concatenate([i[1] for i in inserted])
        n = np.concatenate([i[2] for i in inserted])
        gone = np.concatenate([d[0] for d in deleted]) if deleted else np.array([], np.int64)
        dts = np.concatenate([d[1] for d in deleted]) if deleted else np.array([], np.int64)
        keep = (its <= ts) & ~np.isin(pk, gone[dts <= ts])
        if channel is not None:
            keep &= pk % self.channels == channel
        return pa.table({"pk": pk[keep], "n": n[keep]}).sort_by("pk")

    def channel_ts_after(self, first_op: int, channel: int) -> list[int]:
        """The timestamps on `channel` of the operations from `first_op` on, and of the last
        one before it (the state the channel was in when operation `first_op` began)."""
        with self.lock:
            before = [ts[channel] for _, ts in self.ops[:first_op] if channel in ts]
            after = [ts[channel] for _, ts in self.ops[first_op:] if channel in ts]
        return before[-1:] + after or [0]

    def past_ts(self, rng: random.Random, oldest: int) -> int | None:
        """The timestamp of a message acknowledged MARGIN seconds ago or earlier, but not
        before `oldest`, or just before it."""
        now = time.time()
        with self.lock:
            ops = [ts for at, ts in self.ops if at <= now - MARGIN and min(ts.values()) > oldest]
        if not ops:
            return None
        ts = rng.choice(list(rng.choice(ops).values()))
        return ts - rng.randint(0, 1)


class Load(threading.Thread):
    """Inserts of `rows` new pks, deletes of a few acknowledged ones, a flush now and then."""

    def __init__(self, producer: Producer, info: CollectionInfo, rows: int = 30) -> None:
        super().__init__(daemon=True)
        self.producer, self.info, self.rows = producer, info, rows
        self.acked = Acked(len(info.vchannels))
        self.rng = random.Random(7)
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        pk, alive, batch = 0, [], 0
        vchannels = list(self.info.vchannels)
        try:
            while not self._halt.is_set():
                rows = generate_rows(SCHEMA, self.rows, start_pk=pk, seed=pk)
                appended = self.producer.insert(self.info.name, rows)
                pks = rows["pk"].to_numpy()
                self.acked.record(pks, appended, vchannels, rows["n"].to_numpy())
                alive += pks.tolist()
                pk += self.rows
                gone = np.array([alive.pop(self.rng.randrange(len(alive))) for _ in range(3)], np.int64)
                self.acked.record(gone, self.producer.delete(self.info.name, gone, "_default"), vchannels)
                batch += 1
                if batch % 5 == 0:
                    self.producer.flush(self.info.name)
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(60)


@dataclass
class Read:
    kind: str  # "acked", "past" or "now"
    as_of: int | None
    started: float
    first_op: int  # operations acknowledged when the read began


class Reader(threading.Thread):
    """Reads at T in a loop and checks each against the acknowledged operations."""

    def __init__(self, system: System, info: CollectionInfo, acked: Acked) -> None:
        super().__init__(daemon=True)
        self.system, self.info, self.acked = system, info, acked
        self.catalog = Catalog(system)
        self.rng = random.Random(11)
        self.reads: list[Read] = []
        self.failures: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        kinds = ("acked", "past", "now")
        while not self._halt.is_set() and len(self.failures) < 3:
            ops, last = self.acked.snapshot()
            if not ops:
                time.sleep(0.05)
                continue
            kind = kinds[len(self.reads) % len(kinds)]
            as_of = {"acked": last, "past": self.acked.past_ts(self.rng, self.oldest()), "now": None}[kind]
            if kind == "past" and as_of is None:  # nothing acknowledged long enough ago yet
                time.sleep(0.05)
                continue
            read = Read(kind, as_of, time.time(), ops)
            try:
                self.check(read, self.read(as_of))
            except BaseException:
                self.failures.append(f"{read}: {traceback.format_exc()}")
            self.reads.append(read)

    def oldest(self) -> int:
        """MARGIN seconds inside the time-travel window."""
        return compose_ts(int((time.time() - TIME_TRAVEL + MARGIN) * 1000))

    def read(self, as_of: int | None) -> pa.Table:
        rows = self.catalog.read_collection(self.info.name, as_arrow=True, with_vectors=False, as_of=as_of)
        assert isinstance(rows, pa.Table)
        return rows.select(["pk", "n"]).sort_by("pk")

    def check(self, read: Read, got: pa.Table) -> None:
        pks = got["pk"].to_numpy()
        assert len(np.unique(pks)) == len(pks), f"pks read twice: {_twice(pks)[:10]}"
        if read.as_of is not None:
            _assert_same(got, self.acked.state_at(read.as_of), self.describe)
            return
        # At "now": each vchannel at a boundary between its messages, no earlier than when
        # the read began; wait for the operation in flight when it ended to be acknowledged.
        ops, _ = self.acked.snapshot()
        wait_until(lambda: self.acked.snapshot()[0] > ops or self._halt.is_set(), 30, "the next ack")
        k = self.acked.channels
        for channel in range(k):
            mine = got.filter(pa.array(got["pk"].to_numpy() % k == channel))
            states = [
                self.acked.state_at(ts, channel) for ts in self.acked.channel_ts_after(read.first_op, channel)
            ]
            if not any(state.equals(mine) for state in states):
                closest = min(states, key=lambda state: len(_differ(mine, state)))
                _assert_same(mine, closest, self.describe)

    def describe(self) -> str:
        """The segment meta and checkpoints now, for a failure's message."""
        store = self.system.store
        lines = [
            f"  {s.id} {s.vchannel[-4:]} {s.level.value} {s.state.value} inv={s.is_invisible} "
            f"sorted={s.is_sorted} rows={s.num_rows} dml={s.dml_position.offset if s.dml_position else None} "
            f"dropped_at={s.dropped_at} from={s.compaction_from}"
            for s in collection_segments(store, self.info.id)
        ]
        cps = {v: checkpoint_of(store, v) for v in self.info.vchannels}
        return "\n".join([*lines, f"  checkpoints {cps}"])

    def stop(self) -> None:
        self._halt.set()
        self.join(60)


def _twice(pks: np.ndarray) -> list[int]:
    values, counts = np.unique(pks, return_counts=True)
    return values[counts > 1].tolist()


def _differ(got: pa.Table, want: pa.Table) -> set[int]:
    return set(got["pk"].to_pylist()) ^ set(want["pk"].to_pylist())


def _assert_same(got: pa.Table, want: pa.Table, describe: Callable[[], str]) -> None:
    if got.equals(want):
        return
    g, w = set(got["pk"].to_pylist()), set(want["pk"].to_pylist())
    same_values = got.filter(pc.is_in(got["pk"], pa.array(sorted(g & w), pa.int64()))).equals(
        want.filter(pc.is_in(want["pk"], pa.array(sorted(g & w), pa.int64())))
    )
    raise AssertionError(
        f"missing {sorted(w - g)[:10]} ({len(w - g)}), unexpected {sorted(g - w)[:10]} ({len(g - w)}), "
        f"values of the pks in both {'equal' if same_values else 'differ'}\n{describe()}"
    )


def is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP at its failpoint)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def in_flight(store: MetaStore, info: CollectionInfo) -> set[CompactionType]:
    """The kinds of this collection's plans between their start and their cleanup."""
    states = (PlanState.EXECUTING, PlanState.COMPLETED)
    return {
        d.model.type
        for d in list_plans(store)
        if d.model.collection_id == info.id and d.model.state in states
    }


def kill_at_a_commit_of(
    kinds: set[CompactionType], store: MetaStore, info: CollectionInfo, coord: Role, timeout: float
) -> set[CompactionType]:
    """Let `coord` (stopping at its failpoint) go on past other compactions; SIGKILL it when
    it stops with a plan of one of `kinds` in flight. The kinds in flight then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert coord.alive(), coord.log()[-2000:]
        if is_stopped(coord.pid):
            found = in_flight(store, info)
            if found & kinds:
                coord.kill9()
                return found
            coord.signal(signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError(f"no {kinds} compaction reached its failpoint in {timeout}s")


def settled(store: MetaStore, storage: Storage, info: CollectionInfo) -> bool:
    active = [
        d
        for d in list_plans(store)
        if d.model.collection_id == info.id and d.model.state in (PlanState.PENDING, PlanState.EXECUTING)
    ]
    mine = [s for s in unsorted_segments(store) if s.collection_id == info.id]
    return all_synced(store, storage, [info]) and not active and not mine


# Where the compactor dies, and in which compaction: after its files the commit's kind makes
# no difference to a reader (nothing committed, the plan times out); after the commit an L0
# compaction (its L0 segments Dropped, its targets given their delta logs) and a mix (its
# inputs Dropped, its output served) leave the plan Completed, not Cleaned.
KILLS = [
    ("compaction_after_files", {CompactionType.L0, CompactionType.MIX}),
    ("compaction_after_commit", {CompactionType.L0}),
    ("compaction_before_cleanup", {CompactionType.MIX}),
]


@pytest.mark.parametrize(("step", "kinds"), KILLS, ids=[step for step, _ in KILLS])
def test_reads_at_t_racing_the_lifecycle_and_a_killed_compactor_return_exactly_the_acknowledged_rows(
    step: str, kinds: set[CompactionType], store: MetaStore, settings: Settings, tmp_path: Path
) -> None:
    cluster = Cluster(race_settings(settings), tmp_path)
    storage = Storage.from_settings(cluster.settings)
    system = System(cluster.settings, store, storage)
    producer, [info] = create_collections(store, cluster.settings, count=1, shards=2)
    load = Load(producer, info)
    reader = Reader(system, info, load.acked)

    def coordinator(name: str, **extra: str) -> Role:
        role = Role(
            ["datacoord", "--interval", "0.2", "--engine", "local"],
            cluster.env(**extra),
            cluster.tmp / f"{name}.log",
        )
        cluster.roles.append(role)
        return role

    def plans() -> list[CompactionPlan]:
        return [d.model for d in list_plans(store) if d.model.collection_id == info.id]

    def collected() -> set[int]:
        """Compaction inputs whose meta GC has removed (their files first)."""
        inputs = {i for p in plans() for i in p.input_ids}
        return inputs - {s.id for s in collection_segments(store, info.id)}

    def committed() -> list[CompactionPlan]:
        """Plans whose commit happened (a failed plan is Cleaned too, with no rows in)."""
        return [
            p for p in plans() if p.state is PlanState.COMPLETED or p.state is PlanState.CLEANED and p.rows_in
        ]

    def covered() -> bool:
        every_kind = {p.type for p in committed()} == set(CompactionType)
        return bool(reader.failures or load.error or collected() and every_kind)

    try:
        cluster.node()
        load.start()
        reader.start()
        killed = coordinator("killed", VCHAN_FAILPOINT=f"{step}=stop")
        assert kill_at_a_commit_of(kinds, store, info, killed, timeout=60) & kinds
        coordinator("survivor")
        wait_until(covered, 120, "sort, L0 and mix compactions committed, dropped segments collected", 0.2)
        load.stop()
        producer.flush(info.name)
        producer.time_tick(info.name)
        wait_until(lambda: reader.failures or settled(store, storage, info), 60, "synced, sorted")
    finally:
        load.stop()
        reader.stop()
        cluster.cleanup()
    assert load.error is None, f"producer failed: {load.error!r}"
    assert not reader.failures, "\n".join(reader.failures)
    # At the end, every row once, at the last acknowledged timestamp and at now. That last
    # acknowledgement is made here, after the waits: a read at a timestamp acknowledged before
    # them is refused once they took over TIME_TRAVEL seconds (under load they did).
    final = generate_rows(SCHEMA, 5, start_pk=10_000_000, seed=1)
    appended = producer.insert(info.name, final)
    load.acked.record(final["pk"].to_numpy(), appended, list(info.vchannels), final["n"].to_numpy())
    ops, last = load.acked.snapshot()
    for as_of in (last, None):
        reader.check(Read("final", as_of, time.time(), ops), reader.read(as_of))
    # The race was run: reads of each kind, some at a T before a compaction that had
    # committed when they ran (they read its inputs again), dropped segments collected.
    assert all(sum(r.kind == kind for r in reader.reads) >= 3 for kind in ("acked", "past", "now"))
    commits = [p.finished_at for p in committed()]
    assert any(
        r.as_of and physical_ms(r.as_of) / 1000 < at < r.started for r in reader.reads for at in commits
    )
    assert collected()
