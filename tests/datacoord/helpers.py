"""Shared steps of the coordination tests: real `vchan datanode` / `vchan datacoord`
processes on a real etcd, and views of what etcd says about channels."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from datanode.helpers import SCHEMA, VCHAN, Produced, cli_env, produce

from vchan_assets.config import Settings
from vchan_assets.meta.codec import decode
from vchan_assets.meta.errors import MalformedValueError
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelLease, ChannelWatchInfo, CollectionInfo, MsgPosition, WatchState
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer

# Short timings: a node is declared dead 2-3 s after its last keep-alive.
FAST = {
    "VCHAN_SESSION_TTL": "2",
    "VCHAN_WATCH_TIMEOUT": "10",
    "VCHAN_TICKLER_INTERVAL": "1",
    "VCHAN_SYNC_MAX_AGE": "0.5",
    "VCHAN_ETCD_TIMEOUT": "2",
}


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - started


class Role:
    """A `vchan datanode` or `vchan datacoord` OS process; stderr goes to `log_path`."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in cleanup
        self.process = subprocess.Popen(
            [str(VCHAN), *args], env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self.id = self._started_id()

    def _started_id(self, timeout: float = 60) -> int:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.process.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.cleanup()
                pytest.fail(f"process printed nothing in {timeout}s: {self.log()[-2000:]}")
        line = self.process.stdout.readline()
        if not line:
            pytest.fail(f"process exited with {self.process.wait()}: {self.log()[-3000:]}")
        return int(line.split()[1])  # "datanode 17 started"

    @property
    def pid(self) -> int:
        return self.process.pid

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
    """Processes of one test on its settings; every process is killed at teardown."""

    settings: Settings
    tmp: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    roles: list[Role] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        return cli_env(self.settings, **{**FAST, **self.env_extra, **extra})

    def node(self, engine: str = "local", poll: float = 0.2, **extra: str) -> Role:
        n = len(self.roles)
        role = Role(
            ["datanode", "--engine", engine, "--poll", str(poll)],
            self.env(**extra),
            self.tmp / f"role{n}-datanode.log",
        )
        self.roles.append(role)
        return role

    def coordinator(self, **extra: str) -> Role:
        n = len(self.roles)
        role = Role(
            ["datacoord", "--interval", "0.2"], self.env(**extra), self.tmp / f"role{n}-datacoord.log"
        )
        self.roles.append(role)
        return role

    def cleanup(self) -> None:
        for role in self.roles:
            role.cleanup()


def fast_settings(settings: Settings) -> Settings:
    return replace(settings, session_ttl=2.0, watch_timeout=10.0, tickler_interval=1.0, sync_max_age=0.5)


def create_collections(
    store: MetaStore, settings: Settings, count: int = 2, shards: int = 4
) -> tuple[Producer, list[CollectionInfo]]:
    producer = Producer(store, Storage.from_settings(settings), settings)
    infos = [producer.create_collection(f"c{i}", SCHEMA, num_channels=shards) for i in range(count)]
    return producer, infos


@dataclass(frozen=True)
class Watch:
    node_id: int
    state: WatchState
    lease_id: int | None


def watches(store: MetaStore) -> tuple[dict[str, list[Watch]], dict[str, ChannelLease]]:
    """Every channel's watch infos and its lease, read in ONE etcd snapshot of the root."""
    snap = store.list_prefix(store.keys.root + "/")
    watch_root = store.keys.channel_watch_root()
    lease_root = store.keys.channel_leases()
    out: dict[str, list[Watch]] = {}
    leases: dict[str, ChannelLease] = {}
    for kv in snap.items:
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


def checkpoint_of(store: MetaStore, vchannel: str) -> MsgPosition | None:
    found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    return None if found is None else found.model


def all_synced(store: MetaStore, storage: Storage, infos: list[CollectionInfo]) -> bool:
    """Every channel's checkpoint is at its log's head."""
    from vchan_assets.wal.reader import WalReader

    for info in infos:
        for vchannel in info.vchannels:
            head = WalReader(storage, vchannel, info).head()
            cp = checkpoint_of(store, vchannel)
            if head is not None and (cp is None or cp.offset < head.offset):
                return False
    return True


class Load(threading.Thread):
    """A producer writing batches into the collections until stopped (the "load")."""

    def __init__(self, producer: Producer, infos: list[CollectionInfo], rows: int = 40) -> None:
        super().__init__(daemon=True)
        self.producer = producer
        self.infos = infos
        self.rows = rows
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
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        assert self.error is None, f"producer failed: {self.error}"
