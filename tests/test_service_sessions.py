"""`vchan down` ends what a Dagster deployment leaves of its nodes in etcd."""

from __future__ import annotations

import time
from dataclasses import replace

from vchan_assets.config import Settings
from vchan_assets.deploy.service import end_dagster_hosted_sessions
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import DAGSTER_ADDRESS, NodeSession, SessionState


def _register(store: MetaStore, node_id: int, address: str) -> None:
    now = time.time()
    record = NodeSession(node_id, address, "test", now, SessionState.HEALTHY, now)
    store.cas(store.keys.datanode_session(node_id), 0, record, lease=store.grant(60))


def test_the_stop_ends_every_dagster_hosted_session_and_leaves_other_nodes_alone(
    store: MetaStore, settings: Settings
) -> None:
    """A sensor tick still evaluated while the daemon stops registers a new node after the
    old one left (its session would hold for 60 s with nothing to run it): the stop ends it."""
    _register(store, 11, f"{DAGSTER_ADDRESS}1")
    _register(store, 12, f"{DAGSTER_ADDRESS}2")
    _register(store, 13, "127.0.0.1:7000")  # a standalone `vchan datanode`

    assert end_dagster_hosted_sessions(settings) == 2

    assert store.get(store.keys.datanode_session(11)) is None
    assert store.get(store.keys.datanode_session(12)) is None
    assert store.get(store.keys.datanode_session(13)) is not None
    assert end_dagster_hosted_sessions(settings) == 0


def test_an_unreachable_etcd_does_not_fail_the_stop(
    private_etcd: EmbeddedEtcd, private_settings: Settings
) -> None:
    private_etcd.kill()
    started = time.monotonic()
    assert end_dagster_hosted_sessions(private_settings) == 0
    assert time.monotonic() - started < private_settings.etcd_timeout + 5


def test_a_stack_whose_etcd_is_already_down_stops_without_an_error(settings: Settings) -> None:
    """`vchan down` of the embedded stack: no etcd endpoint is left to reach."""
    assert end_dagster_hosted_sessions(replace(settings, etcd_endpoints=())) == 0
