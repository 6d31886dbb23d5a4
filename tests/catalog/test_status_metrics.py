"""`vchan status --json` and `vchan metrics` on a running system: live node sessions on a
real etcd, watch infos and channel leases, a node killed for real (SIGKILL, its session
lease expires in etcd), its channels moved to the surviving node."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.metrics import parse
from vchan_assets.model import ChannelWatchInfo, NodeSession, VchannelInfo, WatchState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.waiting import wait_until

from .helpers import VCHAN, Known, cli_env

NODE_CHILD = """
import sys, time, threading
from dataclasses import replace
from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import NodeSession
endpoint, root, node_id = sys.argv[1:4]
store = MetaStore.connect(replace(Settings(), etcd_endpoints=(endpoint,), root=root))
node = NodeSession(int(node_id), "127.0.0.1:" + node_id, "test", time.time())
Session.for_datanode(store, node, 1.0).register()
print("registered", flush=True)
threading.Event().wait()
"""


def watch(store: MetaStore, node: int, info: Known, vchannel: str, lease_id: int, state: WatchState) -> None:
    now = time.time()
    value = ChannelWatchInfo(
        vchan=VchannelInfo(info.info.id, vchannel),
        state=state,
        start_ts=now,
        timeout_ts=now + 300,
        lease_id=lease_id,
    )
    store.put(store.keys.channel_watch(node, vchannel), value)


def status_json(settings: Settings, *flags: str) -> dict:
    done = subprocess.run(
        [str(VCHAN), "status", "--json", *flags],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture
def node_process(settings: Settings) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", NODE_CHILD, settings.etcd_endpoints[0], settings.root, "11"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
    yield proc
    proc.kill()
    proc.wait()


def test_status_json_flags_a_killed_nodes_channels_until_they_are_moved(
    settings: Settings, store: MetaStore, known: Known, node_process: subprocess.Popen[str]
) -> None:
    ids = IdAllocator(store)
    survivor = Session.for_datanode(
        store, NodeSession(12, "127.0.0.1:12", "test", time.time()), 10
    ).register()
    try:
        channels = list(known.info.vchannels)
        for vchannel in channels:
            lease = grant_channel_lease(store, ids, vchannel, node_id=11)
            watch(store, 11, known, vchannel, lease.lease_id, WatchState.WATCH_SUCCESS)

        before = status_json(settings)
        assert {n["node_id"]: n["channels"] for n in before["nodes"]} == {11: 2, 12: 0}
        mine = [c for c in before["channels"] if c["collection"] == known.info.name]
        assert {c["owner_node"] for c in mine} == {"11"} and all(c["owner_alive"] for c in mine)
        assert not [w for w in before["warnings"] if w["kind"] == "dead_owner"]

        node_process.kill()  # SIGKILL: no goodbye; etcd expires the session after its TTL
        node_process.wait()
        wait_until(
            lambda: store.get(store.keys.datanode_session(11)) is None,
            15,
            "the killed node's session to expire",
            interval=0.2,
            describe=lambda: store.get(store.keys.datanode_session(11)),
        )

        dead = status_json(settings)
        assert [n["node_id"] for n in dead["nodes"]] == [12]
        warned = {w["vchannel"] for w in dead["warnings"] if w["kind"] == "dead_owner"}
        assert warned == set(channels)

        # The coordinator's move (docs/architecture.md, "Ownership"): watch infos to the live node, fresh leases.
        for vchannel in channels:
            store.delete(store.keys.channel_watch(11, vchannel))
            lease = grant_channel_lease(store, ids, vchannel, node_id=12)
            watch(store, 12, known, vchannel, lease.lease_id, WatchState.WATCH_SUCCESS)

        moved = status_json(settings, "--segments")  # no DataCoord here: no summary
        assert {n["node_id"]: n["channels"] for n in moved["nodes"]} == {12: 2}
        mine = [c for c in moved["channels"] if c["collection"] == known.info.name]
        assert {(c["owner_node"], c["lease_node"], c["owner_alive"]) for c in mine} == {("12", 12, True)}
        assert not [w for w in moved["warnings"] if w["kind"] == "dead_owner"]
        assert {
            (s["state"], s["level"]) for s in moved["segments"] if s["collection"] == known.info.name
        } == {
            ("Flushed", "L1"),
            ("Flushed", "L0"),
        }
    finally:
        survivor.close()


def test_status_warns_of_stuck_watches_timetick_lag_and_orphan_binlogs(
    settings: Settings, store: MetaStore, known: Known
) -> None:
    vchannel = known.info.vchannels[0]
    stuck = ChannelWatchInfo(
        VchannelInfo(known.info.id, vchannel), WatchState.TO_WATCH, time.time() - 400, time.time() - 100
    )
    store.put(store.keys.channel_watch(99, vchannel), stuck)
    storage = Storage.from_settings(settings)
    storage.write_atomic(f"insert_log/{known.info.id}/1/1/0/1.parquet", b"left by a crash")
    from vchan_assets.wal.producer import Producer, generate_rows

    from .helpers import SCHEMA

    Producer(System(settings, store, storage)).insert(
        known.info.name, generate_rows(SCHEMA, 10, start_pk=9000)
    )
    report = status_json(settings, "--orphans")
    kinds = {w["kind"] for w in report["warnings"]}
    assert {"stuck_watch", "orphan_binlogs"} <= kinds
    lagged = subprocess.run(
        [str(VCHAN), "status", "--json"],
        env=cli_env(settings, VCHAN_TIMETICK_LAG_WARN="0.001"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "timetick_lag" in {w["kind"] for w in json.loads(lagged.stdout)["warnings"]}
    table = subprocess.run([str(VCHAN), "status"], env=cli_env(settings), capture_output=True, text=True)
    assert table.returncode == 0 and "stuck_watch" in table.stdout and vchannel in table.stdout


def test_metrics_output_parses_with_counts_and_lags(
    settings: Settings, store: MetaStore, known: Known
) -> None:
    printed = subprocess.run(
        [str(VCHAN), "metrics"], env=cli_env(settings), capture_output=True, text=True, timeout=120
    )
    assert printed.returncode == 0, printed.stderr[-2000:]
    samples = parse(printed.stdout)
    segments = {
        (labels["state"], labels["level"]): value
        for labels, value in samples["vchan_segments"]
        if labels["collection"] == known.info.name
    }
    assert segments[("Flushed", "L1")] >= 2
    lags = [
        v for labels, v in samples["vchan_channel_lag_messages"] if labels["collection"] == known.info.name
    ]
    assert lags == [0, 0]
    assert [v for _, v in samples["vchan_channel_syncs_total"]] == [1, 1]
    assert sum(v for labels, v in samples["vchan_segment_rows"] if labels["level"] == "L1") == 805

    server = subprocess.Popen(
        [str(VCHAN), "metrics", "--serve", "0"], env=cli_env(settings), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().split()[-1]
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            served = parse(response.read().decode())
        assert served["vchan_datanode_sessions"] == [({}, 0.0)]
        assert served.keys() == samples.keys()
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_status_json_with_real_node_processes_shows_a_killed_nodes_channels_moved(
    settings: Settings, store: MetaStore, known: Known, tmp_path: Path
) -> None:
    """`vchan datacoord` and two `vchan datanode` processes; one node is SIGKILLed; the
    report names only the survivor, which watches and holds the lease of every channel."""
    env = cli_env(settings, VCHAN_SESSION_TTL="2")
    procs: dict[str, subprocess.Popen[str]] = {}

    def start(name: str, *args: str) -> None:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        procs[name] = subprocess.Popen(
            [str(VCHAN), *args], env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )

    def report() -> dict:
        done = subprocess.run(
            [str(VCHAN), "status", "--json", "--no-orphans"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    def wait_for(predicate: Callable[[dict], bool], what: str, timeout: float = 60) -> dict:
        seen: list[dict] = []

        def holds() -> bool:
            seen[:] = [report()]
            return predicate(seen[-1])

        def logs() -> str:
            tails = {n: (tmp_path / f"{n}.log").read_text()[-1500:] for n in procs}
            return f"{seen[-1]} {tails}"

        wait_until(holds, timeout, what, interval=0.3, describe=logs)
        return seen[-1]

    def mine(r: dict) -> list[dict]:
        return [c for c in r["channels"] if c["collection"] == known.info.name]

    try:
        start("datacoord", "datacoord", "--interval", "0.3")
        start("node-a", "datanode", "--engine", "local", "--poll", "0.3")
        start("node-b", "datanode", "--engine", "local", "--poll", "0.3")
        balanced = wait_for(
            lambda r: (
                len(r["nodes"]) == 2
                and all(c["watch_state"] == "WatchSuccess" for c in mine(r))
                and len({c["owner_node"] for c in mine(r)}) == 2
            ),
            "one channel watched by each node",
        )
        pid_of = {}
        for name in ("node-a", "node-b"):
            for line in (tmp_path / f"{name}.log").read_text().splitlines():
                if line.startswith("datanode ") and line.endswith(" started"):
                    pid_of[line.split()[1]] = name
        victim = mine(balanced)[0]["owner_node"]
        survivor = next(str(n["node_id"]) for n in balanced["nodes"] if str(n["node_id"]) != victim)
        procs[pid_of[victim]].kill()

        moved = wait_for(
            lambda r: (
                [str(n["node_id"]) for n in r["nodes"]] == [survivor]
                and all(c["owner_node"] == survivor and c["watch_state"] == "WatchSuccess" for c in mine(r))
            ),
            "the killed node's channel moving to the survivor",
        )
        assert all(c["owner_alive"] and str(c["lease_node"]) == survivor for c in mine(moved))
        assert moved["nodes"][0]["channels"] == 2
        assert not [w for w in moved["warnings"] if w["kind"] == "dead_owner"]
        # The segment counts come from the summaries the `vchan datacoord` process wrote.
        assert moved["segments_source"] == "summary"
        assert known.info.name in {s["collection"] for s in moved["segments"]}
        assert not [w for w in moved["warnings"] if "summary" in w["kind"]]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_status_and_metrics_show_every_sessions_state(catalog: Catalog, store: MetaStore) -> None:
    from vchan_assets.metrics import collect, render
    from vchan_assets.model import SessionState
    from vchan_assets.status import active_coordinator, collect_status

    now = time.time()
    held = [
        Session.for_datanode(store, NodeSession(n, "", "0.1.0", now, state, now), ttl=30).register()
        for n, state in ((61, SessionState.HEALTHY), (62, SessionState.STOPPING))
    ]
    coord = NodeSession(60, "host:1", "0.1.0", now, SessionState.STOPPING, now)
    held.append(Session(store, store.keys.datacoord_session(), coord, ttl=30).register())
    try:
        nodes = {n["node_id"]: n for n in collect_status(catalog)["nodes"]}
        assert nodes[61]["state"] == "HEALTHY" and nodes[62]["state"] == "STOPPING"
        assert nodes[62]["state_since"] is not None
        assert active_coordinator(catalog) == "node 60 (host:1) STOPPING"
        states = parse(render(collect(catalog)))["vchan_node_state"]
        assert sorted((lb["role"], lb["node"], lb["state"]) for lb, v in states if v == 1) == [
            ("datacoord", "60", "STOPPING"),
            ("datanode", "61", "HEALTHY"),
            ("datanode", "62", "STOPPING"),
        ]
    finally:
        for s in held:
            s.close()
