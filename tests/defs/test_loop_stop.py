"""The graceful stop of a Dagster-hosted DataNode (defs/sync/loop.py, `NodeSyncLoop.leave`):
its sync loop run executed in its own OS process (`execute_in_process`, what a run worker
executes) and sent SIGTERM, as `vchan down` does to the daemon's process group; real etcd,
real Spark Connect, real files; the coordinator and the node sensors evaluated with
Dagster's own context builder."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import dagster as dg
import psutil

from vchan_assets.config import Settings
from vchan_assets.defs.cluster.datanodes import NodeCursor
from vchan_assets.defs.resources import VchanResource, pyspark_resource
from vchan_assets.defs.sync.loop import AtTeardown, NodeSyncLoop, node_sync_loop_job
from vchan_assets.defs.sync.sensor import dagster_nodes, not_busy, plan_syncs
from vchan_assets.meta.codec import decode
from vchan_assets.meta.store import MetaStore
from vchan_assets.meta.watch import EventKind, poll_changes
from vchan_assets.model import NodeSession, SessionState
from vchan_assets.storage import Storage
from vchan_assets.testing.harness import (
    SCHEMA,
    Produced,
    all_synced,
    cli_env,
    exactly_once,
    owners,
    produce,
    wait_until,
)
from vchan_assets.wal.producer import Producer

from .helpers import NODE1, NODE2, CoordinatorTicks, evaluate, watched_by_a_dagster_node

TTL = 60.0  # a Dagster-hosted node's session TTL (its floor, SESSION_TTL_FLOOR)

LOOP_PROCESS = """
import os
import sys
import dagster as dg
from vchan_assets.config import Settings
from vchan_assets.defs.resources import VchanResource, pyspark_resource
from vchan_assets.defs.sync.loop import AtTeardown, node_sync_loop_job

node_id, lease = int(sys.argv[1]), int(sys.argv[2])
vchan = VchanResource.from_settings(Settings.from_env(dict(os.environ)))
config = {"node_id": node_id, "session_lease": lease, "seconds": 600.0}
with dg.DagsterInstance.ephemeral() as instance:
    result = node_sync_loop_job.execute_in_process(
        run_config={"ops": {"node_sync_loop": {"config": config}}},
        instance=instance,
        resources={"vchan": vchan, "pyspark": pyspark_resource(vchan.settings()), "teardown": AtTeardown()},
        raise_on_error=False,
    )
print("loop run", result.dagster_run.status.value, flush=True)
# What the interpreter's exit waits for, should it take long (in the test's log on a failure).
import faulthandler
faulthandler.dump_traceback_later(15, repeat=True)
"""


def connect_server_pid(url: str) -> int:
    """The pid of the process listening at the Spark Connect URL `sc://host:port`."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise AssertionError(f"no process listens at {url}")


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block, then continued."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def session_states(store: MetaStore, node_id: int, after_revision: int) -> list[str]:
    """What became of the node's session after `after_revision`: its states, DELETE at the end."""
    key = store.keys.datanode_session(node_id)
    changes = poll_changes(store, key, after_revision)
    assert not changes.relisted, changes.reason
    return [
        "DELETE" if e.kind is EventKind.DELETE else decode(key, e.value, NodeSession).state.value
        for e in changes.events
        if e.key == key
    ]


def test_a_node_whose_loop_run_gets_sigterm_says_stopping_and_leaves_at_once(
    instance: dg.DagsterInstance, dsettings: Settings, store: MetaStore, producer: Producer, tmp_path: Path
) -> None:
    settings = replace(dsettings, session_ttl=TTL)
    vchan = VchanResource.from_settings(settings)
    storage = Storage.from_settings(settings)
    info = producer.create_collection("stopping", SCHEMA, [], num_channels=2)
    produced = Produced()
    coordinator = CoordinatorTicks(instance, vchan)
    first = NodeCursor.parse(evaluate(NODE1, instance, vchan).cursor)
    coordinator.tick()  # both channels to the only node
    evaluate(NODE1, instance, vchan, first.dump())  # WatchSuccess
    assert owners(store, list(info.vchannels)) == dict.fromkeys(info.vchannels, first.node_id)
    produce(producer, info.name, produced, 400, start_pk=0, deletes=20)

    log = tmp_path / "loop.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", LOOP_PROCESS, str(first.node_id), str(first.session_lease)],
            env=cli_env(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        synced = lambda: proc.poll() is not None or all_synced(store, storage, [info])  # noqa: E731
        # A ceiling, not a guess of how long it takes: the first sync starts the run's Spark session
        wait_until(synced, 300, "the loop synced both channels")
        assert proc.poll() is None, log.read_text()
        produce(producer, info.name, produced, 300, start_pk=10_000)  # for the loop's next sync
        before = store.list_prefix(store.keys.datanode_session.prefix).revision
        # Its Spark Connect server does not answer (SIGSTOP: a server stalled by load or GC):
        # the node leaves all the same, and its run worker exits.
        with frozen(connect_server_pid(settings.spark_remote)):
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            key = store.keys.datanode_session(first.node_id)
            wait_until(lambda: store.get(key) is None, 20, "the node's session is gone")
            gone = time.monotonic() - sent
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # the log ends with the stacks its exit waits in
                raise AssertionError(f"still running 60 s after SIGTERM: {log.read_text()[-8000:]}") from None
            assert code == 0, log.read_text()[-3000:]
            exited = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    output = log.read_text()
    print(output[-3000:])
    print(f"session gone {gone:.2f}s, process exited {exited:.2f}s after SIGTERM (TTL {TTL:.0f}s)")
    assert gone < TTL / 4, gone
    assert session_states(store, first.node_id, before) == ["STOPPING", "DELETE"]
    assert f"node {first.node_id} left" in output and "loop run FAILURE" in output

    # The coordinator gives the channels to another node at once (registered now: a session
    # registered before the loop ran would have to outlive its TTL on a loaded machine); it
    # syncs them from the checkpoints, and every row is there exactly once.
    second = NodeCursor.parse(evaluate(NODE2, instance, vchan).cursor)
    coordinator.tick()
    evaluate(NODE2, instance, vchan, second.dump())  # WatchSuccess
    assert owners(store, list(info.vchannels)) == dict.fromkeys(info.vchannels, second.node_id)
    produce(producer, info.name, produced, 200, start_pk=20_000, deletes=10)
    time.sleep(1.1)  # VCHAN_SYNC_MAX_AGE=1
    with vchan.open() as runtime:
        loop = NodeSyncLoop(
            runtime.with_spark(pyspark_resource(settings).spark_session), instance, second.node_id
        )
        try:
            deadline = time.monotonic() + 60
            while not all_synced(store, storage, [info]) and time.monotonic() < deadline:
                loop.step()
                time.sleep(0.2)
        finally:
            loop.close()
    tally = exactly_once(store, storage, info, produced)
    assert tally.ok, tally.describe()


def test_a_stopping_node_gets_no_syncs_and_its_sensor_starts_a_new_node(
    instance: dg.DagsterInstance, dsettings: Settings, store: MetaStore, producer: Producer
) -> None:
    """While a node is STOPPING (its loop is leaving), nothing syncs as it, its loop sees it
    gone, and its sensor neither refreshes it nor writes it HEALTHY: the slot gets a new node."""
    vchan = VchanResource.from_settings(replace(dsettings, session_ttl=TTL))
    info = producer.create_collection("leaving", SCHEMA, [], num_channels=1)
    node, _ = watched_by_a_dagster_node(instance, vchan, store)
    produce(producer, info.name, Produced(), 100, start_pk=0)
    time.sleep(1.1)  # VCHAN_SYNC_MAX_AGE=1: the sync policies fire
    with vchan.open() as runtime:
        assert not_busy(instance, plan_syncs(runtime, nodes={node.node_id}))

        key = store.keys.datanode_session(node.node_id)
        found = store.get_model(key, NodeSession)
        assert found is not None
        store.cas(key, found.kv.version, found.model.entered(SessionState.STOPPING), lease=found.kv.lease)

        assert node.node_id not in dagster_nodes(runtime)
        assert not not_busy(instance, plan_syncs(runtime))
        loop = NodeSyncLoop(runtime, instance, node.node_id, node.session_lease)
        assert not loop.alive()
        loop.close()

    tick = evaluate(NODE1, instance, vchan, node.dump())
    new = NodeCursor.parse(tick.cursor)
    assert new.node_id != node.node_id
    still = store.get_model(key, NodeSession)
    assert still is not None and still.model.state is SessionState.STOPPING


class InterruptOnMaterialization(logging.Handler):
    """Sends this process SIGINT when Dagster logs the loop's first materialization: the
    signal arrives while Dagster (not the op) runs, as it does when a run worker gets SIGTERM
    while Dagster stores an event the loop reported."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.sent and "ASSET_MATERIALIZATION" in record.getMessage():
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


def test_a_loop_interrupted_while_dagster_stores_its_event_still_leaves_at_once(
    instance: dg.DagsterInstance, dsettings: Settings, store: MetaStore, producer: Producer
) -> None:
    """Dagster raises such an interrupt outside the op, whose generator is closed only after
    the run: the node leaves from the teardown of the run's resources (`AtTeardown`)."""
    vchan = VchanResource.from_settings(replace(dsettings, session_ttl=TTL))
    info = producer.create_collection("interrupted", SCHEMA, [], num_channels=1)
    node, _ = watched_by_a_dagster_node(instance, vchan, store)
    produce(producer, info.name, Produced(), 100, start_pk=0)
    time.sleep(1.1)  # VCHAN_SYNC_MAX_AGE=1: the sync policy fires
    handler = InterruptOnMaterialization()

    @dg.logger
    def interrupting(_: dg.InitLoggerContext) -> logging.Logger:
        logger = logging.Logger("interrupting", level=logging.DEBUG)
        logger.addHandler(handler)
        return logger

    job = node_sync_loop_job.graph.to_job(
        name="interrupted_loop",
        executor_def=dg.in_process_executor,
        logger_defs={"interrupting": interrupting},
    )
    before = store.list_prefix(store.keys.datanode_session.prefix).revision
    config = {"node_id": node.node_id, "session_lease": node.session_lease, "seconds": 600.0}
    result = job.execute_in_process(
        run_config={"ops": {"node_sync_loop": {"config": config}}, "loggers": {"interrupting": {}}},
        instance=instance,
        resources={"vchan": vchan, "pyspark": pyspark_resource(vchan.settings()), "teardown": AtTeardown()},
        raise_on_error=False,
    )

    assert handler.sent and not result.success
    assert result.asset_materializations_for_node("node_sync_loop")  # the op got as far
    key = store.keys.datanode_session(node.node_id)
    assert store.get(key) is None  # gone when the run ended, not after the TTL
    changes = poll_changes(store, key, before)
    stopping = [decode(key, e.value, NodeSession) for e in changes.events if e.kind is EventKind.PUT]
    assert [s.state for s in stopping] == [SessionState.STOPPING]
    assert "while Dagster stored an event" in stopping[0].reason  # left from the teardown
