"""Real processes under faults, for the tests and the benchmarks that need them.

- **Cluster and roles**: `vchan datanode` / `vchan datacoord` OS processes on one
  `Settings`, with short timings (`FAST`: a node is declared dead 2-3 s after its last
  keep-alive), and what etcd says of them: `owners` (every channel watched by exactly one
  node, under its current lease), `all_synced` (every checkpoint at its log's head), and
  `OneWriterChecker`, which samples etcd for a channel with two writers.
- **Produced data**: batches of known rows and deletes written through a `Producer`, and
  `exactly_once`, which reads the live segments' binlogs and delta logs back with plain
  pyarrow and compares them with what was produced, value by value; `Load`, a producer
  thread writing batches until stopped.
- **Chaos**: `ChaosSchedule`, a seeded random schedule of faults (kill -9 of a node or a
  coordinator, SIGSTOP of a node past its session TTL, kill -9 and restart of etcd) under
  a `PausableLoad`, the producer that stops between batches while etcd is down.

Nothing is simulated: every role is a real `vchan` process, etcd is the real binary.
"""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.config import Settings
from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MalformedValueError, MetaError
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import (
    ChannelLease,
    ChannelWatchInfo,
    CollectionInfo,
    CollectionSchema,
    MsgPosition,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    WatchState,
)
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer, generate_rows
from vchan_assets.wal.reader import WalReader

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "f": "float", "s": "string", "b": "bool"})
VCHAN = Path(sys.executable).parent / "vchan"
COLUMNS = ("pk", "n", "f", "s", "b", "vec")

# Short timings: a node is declared dead 2-3 s after its last keep-alive.
FAST = {
    "VCHAN_SESSION_TTL": "2",
    "VCHAN_WATCH_TIMEOUT": "10",
    "VCHAN_TICKLER_INTERVAL": "1",
    "VCHAN_SYNC_MAX_AGE": "0.5",
    "VCHAN_ETCD_TIMEOUT": "2",
}


def fast_settings(settings: Settings) -> Settings:
    """`settings` with the timings of `FAST`."""
    return replace(settings, session_ttl=2.0, watch_timeout=10.0, tickler_interval=1.0, sync_max_age=0.5)


def cli_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a `vchan` process on `settings` (no VCHAN_* of this process's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(settings.to_env())  # every setting, so the child runs on exactly these
    if settings.s3_endpoint:
        for key in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_EC2_METADATA_DISABLED",
        ):
            if key in os.environ:
                env[key] = os.environ[key]
    env.update(extra)
    return env


class Role:
    """A `vchan datanode` or `vchan datacoord` OS process; stderr goes to `log_path`.
    Constructed, it has started (printed its id); with `wait=False` it is only spawned, and
    `started()` waits for it (roles spawned together start side by side)."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, wait: bool = True) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in cleanup
        self.process = subprocess.Popen(
            [str(VCHAN), *args], env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self._id = self._started_id() if wait else None

    @property
    def id(self) -> int:
        """The node or server id the process printed at start (waited for, if not yet)."""
        if self._id is None:
            self._id = self._started_id()
        return self._id

    def started(self) -> Role:
        """This role once its process printed its id."""
        if self._id is None:
            self._id = self._started_id()
        return self

    def _started_id(self, timeout: float = 60) -> int:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.process.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.cleanup()
                raise RuntimeError(f"process printed nothing in {timeout}s: {self.log()[-2000:]}")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited with {self.process.wait()}: {self.log()[-3000:]}")
        return int(line.split()[1])  # "datanode 17 started"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def terminate(self, timeout: float = 60) -> int:
        self.signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.process.wait(10)

    def cleanup(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


@dataclass
class Cluster:
    """Processes on one `Settings`; `cleanup` kills every one still running.
    `coordinator_engine`: where the coordinators run their sorts, compactions and builds
    (`local`: in the process, no Spark JVM beside a test that is not about Spark)."""

    settings: Settings
    tmp: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    roles: list[Role] = field(default_factory=list)
    coordinator_engine: str = "spark"

    def env(self, **extra: str) -> dict[str, str]:
        return cli_env(self.settings, **{**FAST, **self.env_extra, **extra})

    def node(self, engine: str = "local", poll: float = 0.2, wait: bool = True, **extra: str) -> Role:
        """A `vchan datanode`; `wait=False`: only spawned (`Role.started` waits for it)."""
        n = len(self.roles)
        role = Role(
            ["datanode", "--engine", engine, "--poll", str(poll)],
            self.env(**extra),
            self.tmp / f"role{n}-datanode.log",
            wait,
        )
        self.roles.append(role)
        return role

    def coordinator(self, wait: bool = True, **extra: str) -> Role:
        """A `vchan datacoord` on `coordinator_engine`; `wait=False` as for `node`."""
        n = len(self.roles)
        role = Role(
            ["datacoord", "--interval", "0.2", "--engine", self.coordinator_engine],
            self.env(**extra),
            self.tmp / f"role{n}-datacoord.log",
            wait,
        )
        self.roles.append(role)
        return role

    def cleanup(self) -> None:
        for role in self.roles:
            role.cleanup()


def create_collections(
    store: MetaStore, settings: Settings, count: int = 2, shards: int = 4
) -> tuple[Producer, list[CollectionInfo]]:
    producer = Producer(System(settings, store, Storage.from_settings(settings)))
    infos = [producer.create_collection(f"c{i}", SCHEMA, num_channels=shards) for i in range(count)]
    return producer, infos


def checkpoint_of(store: MetaStore, vchannel: str) -> MsgPosition | None:
    found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    return None if found is None else found.model


@dataclass(frozen=True)
class SyncLag:
    """The channels whose checkpoint is behind their log's head: true when there are none.
    Its repr names each with its watch infos, read then (what a wait on `all_synced` says
    when it times out)."""

    behind: tuple[tuple[str, str], ...] = ()  # (vchannel, "checkpoint C < head H")
    store: MetaStore | None = field(default=None, compare=False)

    def __bool__(self) -> bool:
        return not self.behind

    def __repr__(self) -> str:
        if not self.behind:
            return "every channel at its head"
        try:
            found = watches(self.store)[0] if self.store is not None else {}
        except MetaError as exc:
            found, self_error = {}, f" (watch infos unreadable: {exc})"
        else:
            self_error = ""
        return (
            "; ".join(
                f"{v}: {lag}, watched by {[(w.node_id, w.state.value) for w in found.get(v, [])]}"
                for v, lag in self.behind
            )
            + self_error
        )


def all_synced(store: MetaStore, storage: Storage, infos: list[CollectionInfo]) -> SyncLag:
    """Every channel's checkpoint is at its log's head (true), or the ones that are not."""
    behind = []
    for info in infos:
        for vchannel in info.vchannels:
            head = WalReader(storage, vchannel, info).head()
            cp = checkpoint_of(store, vchannel)
            if head is not None and (cp is None or cp.offset < head.offset):
                at = "no checkpoint" if cp is None else f"checkpoint {cp.offset}"
                behind.append((vchannel, f"{at} < head {head.offset}"))
    return SyncLag(tuple(behind), store)


@dataclass(frozen=True)
class Watch:
    node_id: int
    state: WatchState
    lease_id: int | None


def watches(store: MetaStore) -> tuple[dict[str, list[Watch]], dict[str, ChannelLease]]:
    """Every channel's watch infos and its lease, read in ONE etcd snapshot (both prefixes at
    one revision; not the whole root, whose segment meta grows under a load)."""
    watch_root = store.keys.channel_watch.prefix
    lease_root = store.keys.channel_lease.prefix
    watch_kvs, lease_kvs = store.list_prefixes([watch_root, lease_root])
    out: dict[str, list[Watch]] = {}
    leases: dict[str, ChannelLease] = {}
    for kv in [*watch_kvs, *lease_kvs]:
        if kv.key.startswith(watch_root):
            node, _, vchannel = kv.key[len(watch_root) :].partition("/")
            if not node.isdigit():
                continue
            try:
                info = decode(kv.key, kv.value, ChannelWatchInfo)
            except MalformedValueError:
                continue
            out.setdefault(vchannel, []).append(Watch(int(node), info.state, info.lease_id))
        elif kv.key.startswith(lease_root):
            leases[kv.key[len(lease_root) :]] = decode(kv.key, kv.value, ChannelLease)
    return out, leases


def owners(store: MetaStore, channels: list[str]) -> dict[str, int] | None:
    """vchannel -> node if every channel has exactly one watch info, WatchSuccess, whose
    lease is the channel's current lease; None otherwise."""
    found, leases = watches(store)
    out = {}
    for vchannel in channels:
        ws = found.get(vchannel, [])
        if len(ws) != 1 or ws[0].state is not WatchState.WATCH_SUCCESS:
            return None
        lease = leases.get(vchannel)
        if lease is None or lease.lease_id != ws[0].lease_id or lease.node_id != ws[0].node_id:
            return None
        out[vchannel] = ws[0].node_id
    return out


# --- produced data, and reading it back ------------------------------------------------


@dataclass
class Produced:
    """What was written into the log, to compare the binlogs against."""

    rows: list[pa.Table] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)

    @property
    def table(self) -> pa.Table:
        return pa.concat_tables(self.rows)

    @property
    def row_count(self) -> int:
        return sum(t.num_rows for t in self.rows)


def produce(
    producer: Producer, name: str, produced: Produced, n: int, start_pk: int, deletes: int = 0
) -> None:
    """Insert `n` rows of `SCHEMA` from `start_pk` (values seeded by it), then delete the
    first `deletes` of them; both recorded in `produced`."""
    rows = generate_rows(SCHEMA, n, start_pk=start_pk, seed=start_pk)
    producer.insert(name, rows)
    produced.rows.append(rows)
    if deletes:
        pks = list(range(start_pk, start_pk + deletes))
        producer.delete(name, pks, partition="_default")
        produced.deleted.extend(pks)


def segments(store: MetaStore, info: CollectionInfo) -> list[SegmentInfo]:
    """Every segment of `info`, the Dropped ones GC has not deleted yet included."""
    found = SegmentMeta(store).list(info.id, include_dropped=True)
    return [d.model for d in found]


def live_segments(segs: list[SegmentInfo]) -> list[SegmentInfo]:
    """The segments a reader sees: compaction drops its inputs (applying their deletes)."""
    return [s for s in segs if s.state is not SegmentState.DROPPED]


def insert_rows(storage: Storage, segs: list[SegmentInfo]) -> pa.Table:
    """Every row of the L1 segments' binlogs, scalar group joined with the vector group,
    each file read whole as Parquet (as any engine could)."""
    tables = []
    for seg in segs:
        if seg.level is SegmentLevel.L0:
            continue
        groups = {g.group: g for g in seg.binlogs}
        for scalar_log, vector_log in zip(groups[0].logs, groups[max(groups)].logs, strict=True):
            scalars = storage.read_parquet(scalar_log.path)
            vectors = storage.read_parquet(vector_log.path)
            assert scalars["row_id"].equals(vectors["row_id"]), "column groups are not aligned"
            tables.append(scalars.append_column("vec", vectors["vec"]))
    return pa.concat_tables(tables) if tables else pa.table({"pk": pa.array([], pa.int64())})


def delete_pks(storage: Storage, segs: list[SegmentInfo]) -> list[int]:
    pks: list[int] = []
    for seg in segs:
        for delta in seg.deltalogs:
            pks += storage.read_parquet(delta.path, ["pk"])["pk"].to_pylist()
    return pks


def read_inserted(store: MetaStore, storage: Storage, info: CollectionInfo) -> pa.Table:
    """Every row of every L1 segment's binlogs, Dropped ones too."""
    return insert_rows(storage, segments(store, info))


def read_deleted(store: MetaStore, storage: Storage, info: CollectionInfo) -> list[int]:
    """Every pk of every segment's delta logs, Dropped ones too."""
    return delete_pks(storage, segments(store, info))


@dataclass(frozen=True)
class Tally:
    """The live segments against what was produced: rows lost (neither persisted nor
    deleted), persisted more than once or never produced, columns whose values differ on
    the pks persisted once; deletes lost (the row still visible, or a delete of a pk never
    inserted missing), in more than one L0 delta log, or never produced."""

    rows: int
    deletes: int
    lost: list[int]
    duplicated: list[int]
    unexpected: list[int]
    differing: list[str]
    deletes_lost: list[int]
    deletes_duplicated: list[int]
    deletes_unexpected: list[int]

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.unexpected
            or self.differing
            or self.deletes_lost
            or self.deletes_duplicated
            or self.deletes_unexpected
        )

    def describe(self) -> str:
        def some(pks: list[int]) -> str:
            return f"{len(pks)}" + (f" (e.g. {pks[:5]})" if pks else "")

        return (
            f"{self.rows} rows: {some(self.lost)} lost, {some(self.duplicated)} persisted more than once, "
            f"{some(self.unexpected)} never produced, differing columns {self.differing or 'none'}; "
            f"{self.deletes} deletes: {some(self.deletes_lost)} lost, "
            f"{some(self.deletes_duplicated)} more than once, {some(self.deletes_unexpected)} never produced"
        )


def exactly_once(store: MetaStore, storage: Storage, info: CollectionInfo, produced: Produced) -> Tally:
    """Read the live segments' binlogs and delta logs and compare them with `produced`,
    value by value. Compaction (sort, mix, L0) may have rewritten segments: a row it
    removed must have been deleted, a delete it applied leaves no row of its pk behind."""
    segs = live_segments(segments(store, info))
    got = insert_rows(storage, segs)
    expected = produced.table
    counts = Counter(got["pk"].to_pylist())
    inserted = set(expected["pk"].to_pylist())
    deleted = set(produced.deleted)
    once = pa.array(sorted(pk for pk, c in counts.items() if c == 1 and pk in inserted), pa.int64())
    mine = got.filter(pc.is_in(got["pk"], value_set=once)).sort_by("pk")
    want = expected.filter(pc.is_in(expected["pk"], value_set=once)).sort_by("pk")
    deletes = set(delete_pks(storage, segs))
    l0_deletes = Counter(delete_pks(storage, [s for s in segs if s.level is SegmentLevel.L0]))
    return Tally(
        rows=expected.num_rows,
        deletes=len(produced.deleted),
        lost=sorted(inserted - deleted - counts.keys()),
        duplicated=sorted(pk for pk, c in counts.items() if c > 1),
        unexpected=sorted(counts.keys() - inserted),
        differing=[c for c in COLUMNS if not mine[c].equals(want[c])],
        deletes_lost=sorted(pk for pk in deleted - deletes if pk in counts or pk not in inserted),
        deletes_duplicated=sorted(pk for pk, c in l0_deletes.items() if c > 1),
        deletes_unexpected=sorted(deletes - deleted),
    )


# --- chaos --------------------------------------------------------------------------


class PausableLoad(threading.Thread):
    """A producer writing batches until stopped; paused (between batches) while etcd is
    down, so that no insert ends in doubt (appended or not) and `produced` is exact."""

    def __init__(
        self, producer: Producer, info: CollectionInfo, rows: int = 40, period: float = 0.05
    ) -> None:
        super().__init__(daemon=True)
        self.producer, self.info, self.rows, self.period = producer, info, rows, period
        self.produced = Produced()
        self.error: BaseException | None = None
        self._go, self._idle, self._halt = threading.Event(), threading.Event(), threading.Event()
        self._go.set()

    def run(self) -> None:
        pk = 1
        try:
            while not self._halt.is_set():
                if not self._go.is_set():
                    self._idle.set()
                    self._go.wait(0.1)
                    continue
                self._idle.clear()
                produce(self.producer, self.info.name, self.produced, self.rows, pk, deletes=2)
                pk += self.rows
                time.sleep(self.period)
        except BaseException as exc:
            self.error = exc

    def pause(self) -> None:
        self._go.clear()
        wait_until(self._idle.is_set, 60, "the producer to finish its batch")

    def resume(self) -> None:
        self._idle.clear()  # the next pause waits for the producer to stop again
        self._go.set()

    def stop(self) -> None:
        """Stop after the current batch; raises what the producer raised, if anything."""
        self._halt.set()
        self._go.set()
        self.join(60)
        if self.error is not None:
            raise RuntimeError(f"producer failed: {self.error}") from self.error


class Restartable(Protocol):
    def kill(self) -> None: ...
    def restart(self, timeout: float = 30.0) -> None: ...


FAULTS = ("kill_node", "kill_coordinator", "pause_node_past_ttl", "restart_etcd")


def live(roles: list[Role]) -> list[Role]:
    return [r for r in roles if r.alive()]


class ChaosSchedule:
    """A seeded random schedule of faults against `cluster`'s nodes and coordinators and
    its etcd, under `load`. Before each fault, roles that died (killed, or exited after
    losing their session) are replaced up to `nodes` / `coordinators`; after it, a random
    pause of `gap` seconds (low, high). The same seed gives the same sequence of faults
    and victims, whatever the gap. etcd has `etcd_timeout` seconds to come back."""

    def __init__(
        self,
        cluster: Cluster,
        etcd: Restartable,
        load: PausableLoad,
        seed: int,
        nodes: int = 3,
        coordinators: int = 2,
        gap: tuple[float, float] = (1.0, 4.0),
        etcd_timeout: float = 30.0,
    ) -> None:
        self.cluster, self.etcd, self.load = cluster, etcd, load
        self.rng = random.Random(seed)
        self.gap, self.etcd_timeout = gap, etcd_timeout
        self.etcd_restarts: list[float] = []  # seconds from each kill -9 of etcd to its health
        self.want_nodes, self.want_coordinators = nodes, coordinators
        self.nodes: list[Role] = []
        self.coordinators: list[Role] = []
        self.survived: list[str] = []
        self.last_fault_end: float | None = None

    def replenish(self, nodes: int, coordinators: int) -> None:
        """Start roles until `nodes` nodes and `coordinators` coordinators are alive; the
        dead ones' pipes and logs are closed (a long run starts hundreds)."""
        for role in self.nodes + self.coordinators:
            if not role.alive():
                role.cleanup()
        self.nodes = live(self.nodes)
        self.coordinators = live(self.coordinators)
        # Spawned together, then waited for: their starts (imports, etcd sessions) overlap.
        new = [self.cluster.node(wait=False) for _ in range(nodes - len(self.nodes))]
        new_coordinators = [
            self.cluster.coordinator(wait=False) for _ in range(coordinators - len(self.coordinators))
        ]
        self.nodes += [role.started() for role in new]
        self.coordinators += [role.started() for role in new_coordinators]

    def fault(self) -> str:
        """Replace dead roles, then inflict one fault; its name."""
        self.replenish(self.want_nodes, self.want_coordinators)
        fault = self.rng.choice(FAULTS)
        if fault == "kill_node":
            self.rng.choice(live(self.nodes)).kill9()
        elif fault == "kill_coordinator":
            self.rng.choice(live(self.coordinators)).kill9()
        elif fault == "pause_node_past_ttl":
            victim = self.rng.choice(live(self.nodes))
            victim.signal(signal.SIGSTOP)
            time.sleep(self.cluster.settings.session_ttl + 1)  # its session expires: fenced, channels move
            victim.signal(signal.SIGCONT)
        else:
            self.load.pause()
            killed = time.monotonic()
            self.etcd.kill()
            self.etcd.restart(timeout=self.etcd_timeout)
            self.etcd_restarts.append(time.monotonic() - killed)
            self.load.resume()
        self.survived.append(fault)
        self.last_fault_end = time.monotonic()
        return fault

    def run(
        self,
        seconds: float = float("inf"),
        on_fault: Callable[[str], None] | None = None,
        faults: int | None = None,
    ) -> list[str]:
        """Faults for `seconds`, or `faults` of them (a test means a number of faults: on a
        loaded machine each takes longer); the faults survived, in order."""
        if seconds == float("inf") and faults is None:
            raise ValueError("a chaos run needs seconds or a number of faults")
        ends = time.monotonic() + seconds
        while time.monotonic() < ends and (faults is None or len(self.survived) < faults):
            fault = self.fault()
            if on_fault is not None:
                on_fault(fault)
            time.sleep(self.rng.uniform(*self.gap))
        return self.survived


class OneWriterChecker(threading.Thread):
    """Samples etcd continuously; records every moment a channel had two WatchSuccess
    infos, or a WatchSuccess whose lease was not the channel's current lease holder's
    while another node's WatchSuccess held it."""

    def __init__(self, store: MetaStore, channels: list[str]) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.channels = channels
        self.samples = 0
        self.violations: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            found, leases = watches(self.store)
            self.samples += 1
            for vchannel in self.channels:
                holders = [w for w in found.get(vchannel, []) if w.state is WatchState.WATCH_SUCCESS]
                if len(holders) > 1:
                    self.violations.append(f"{vchannel}: two watchers {holders}")
                lease = leases.get(vchannel)
                for w in holders:
                    if lease is not None and lease.lease_id != w.lease_id and len(holders) > 1:
                        self.violations.append(f"{vchannel}: {w} without the lease {lease}")
            time.sleep(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


class Load(threading.Thread):
    """A producer writing batches into the collections until stopped (the "load"), a pause
    of `period` seconds after each round."""

    def __init__(
        self, producer: Producer, infos: list[CollectionInfo], rows: int = 40, period: float = 0.05
    ) -> None:
        super().__init__(daemon=True)
        self.producer = producer
        self.infos = infos
        self.rows = rows
        self.period = period
        self.produced = {info.name: Produced() for info in infos}
        self.batches = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        pk = 1
        try:
            while not self._halt.is_set():
                for info in self.infos:
                    produce(self.producer, info.name, self.produced[info.name], self.rows, pk, deletes=2)
                    pk += self.rows
                self.batches += 1
                time.sleep(self.period)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        assert self.error is None, f"producer failed: {self.error}"
