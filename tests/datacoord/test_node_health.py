"""A DataNode is HEALTHY only while it can work: a real `vchan datanode --engine spark`
whose Spark JVM is killed (SIGKILL of the py4j gateway's child process) under load says
ABNORMAL with the reason (shown by `vchan status`), its channels move to the other node,
it starts a new Spark session and is HEALTHY again; nothing is lost or duplicated."""

from __future__ import annotations

import os
import signal

from vchan_assets.catalog import Catalog
from vchan_assets.deploy.processes import command_line, descendants
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import NodeSession, SessionState
from vchan_assets.status import collect_status
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    Cluster,
    Load,
    OneWriterChecker,
    Role,
    checkpoint_of,
    create_collections,
    owners,
)
from vchan_assets.testing.steps import finish_and_check
from vchan_assets.testing.waiting import wait_until


def _jvm_of(role: Role) -> int:
    """The pid of the node's Spark JVM: its `java` process (processes that exit while
    /proc is read are left out)."""
    below = descendants(role.pid)
    java = [pid for pid in below if command_line(pid).split(" ", 1)[0].endswith("java")]
    assert len(java) == 1, ({pid: command_line(pid)[:80] for pid in below}, java)
    return java[0]


def _session(store: MetaStore, node: Role) -> NodeSession | None:
    found = store.get_model(store.keys.datanode_session(node.id), NodeSession)
    return None if found is None else found.model


def test_a_datanode_whose_spark_jvm_dies_goes_abnormal_its_channels_move_and_it_recovers(
    cluster: Cluster, store: MetaStore
) -> None:
    cluster.env_extra["VCHAN_SESSION_TTL"] = "6"  # a JVM starting on a loaded machine starves keep-alives
    # The node's JVM is the one under test: the coordinator sorts in its own process, so no
    # second JVM competes with the node's two starts.
    cluster.coordinator_engine = "local"
    producer, infos = create_collections(store, cluster.settings, count=1, shards=4)
    channels = list(infos[0].vchannels)
    # Spawned together (the Spark node's JVM starts while the others do), then waited for.
    spark = cluster.node(engine="spark", wait=False, VCHAN_HEALTH_INTERVAL="1")
    other = cluster.node(wait=False)
    cluster.coordinator(wait=False)
    for role in cluster.roles:
        role.started()
    load = Load(producer, infos)
    load.start()

    def spark_holds_channels() -> bool:
        now = owners(store, channels)
        return now is not None and spark.id in now.values() and other.id in now.values()

    wait_until(spark_holds_channels, 180, "the Spark node HEALTHY and given channels by balance")
    wait_until(lambda: all(checkpoint_of(store, v) for v in channels), 30, "every channel synced once")
    checker = OneWriterChecker(store, channels)
    checker.start()
    jvm = _jvm_of(spark)

    os.kill(jvm, signal.SIGKILL)

    def says_abnormal() -> bool:
        session = _session(store, spark)
        return session is not None and session.state is SessionState.ABNORMAL

    wait_until(says_abnormal, 30, "the node ABNORMAL")
    session = _session(store, spark)
    assert session is not None and "Spark session does not answer" in session.reason, session
    with Catalog(System(cluster.settings, store, Storage.from_settings(cluster.settings))) as catalog:
        [shown] = [n for n in collect_status(catalog)["nodes"] if n["node_id"] == spark.id]
    assert shown["state"] in ("ABNORMAL", "HEALTHY")  # (it may have recovered already)
    if shown["state"] == "ABNORMAL":
        assert "does not answer" in shown["state_reason"]
    # Its channels move at once (the new JVM takes seconds to start: it is still ABNORMAL).
    wait_until(
        lambda: set((owners(store, channels) or {0: 0}).values()) == {other.id},
        30,
        "the ABNORMAL node's channels moved to the other node",
    )

    def recovered() -> bool:
        now = _session(store, spark)
        return now is not None and now.state is SessionState.HEALTHY and owners(store, channels) is not None

    wait_until(  # a second JVM start on a loaded machine: a generous ceiling, and the node's log if it fails
        recovered,
        300,
        "the node HEALTHY again on a new Spark session",
        describe=lambda: f"{_session(store, spark)}; the node's log ends: {spark.log()[-3000:]}",
    )
    assert spark.alive() and _jvm_of(spark) != jvm
    assert spark.log().count("Spark session up") == 2
    finish_and_check(cluster, store, (producer, infos), load)
    checker.stop()
    assert not checker.violations, checker.violations[:5]
