"""The Dagster deployment of a cluster on PostgreSQL: dagster-daemon + dagster-webserver
(DagsterService) with the instance's storage on a real `postgres` (deploy/postgres.py),
a real etcd, Spark Connect and files. The sensors watch and sync through runs recorded in
Postgres; a kill -9 of Postgres under load is healed by the supervisor and nothing is lost
or duplicated."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import dagster as dg
import psycopg2
import pytest

from vchan_assets.config import Settings
from vchan_assets.defs.sync.jobs import LOOP_JOB
from vchan_assets.deploy.postgres import PostgresServer
from vchan_assets.deploy.service import DagsterService, daemon_state, graphql
from vchan_assets.deploy.supervisor import Supervisor
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import DAGSTER_ADDRESS, NodeSession
from vchan_assets.storage import Storage
from vchan_assets.testing import waiting
from vchan_assets.testing.harness import SCHEMA, PausableLoad, all_synced, exactly_once, owners
from vchan_assets.wal.producer import Producer

from .helpers import after_a_run_start, live_settings, running

wait_until = partial(waiting.wait_until, interval=0.25)  # some of its conditions ask the webserver
IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]


@dataclass
class PgDeployment:
    url: str
    settings: Settings
    store: MetaStore
    postgres: PostgresServer
    service: DagsterService
    producer: Producer
    home: Path


def _sql(postgres: PostgresServer, query: str) -> list[tuple[object, ...]]:
    with psycopg2.connect(postgres.url) as conn, conn.cursor() as cursor:
        cursor.execute(query)
        return list(cursor.fetchall())


def _dagster_nodes(store: MetaStore) -> list[int]:
    """The Dagster-hosted nodes with a session in etcd."""
    found, _ = store.list_models(store.keys.datanode_session.prefix, NodeSession, skip_malformed=True)
    return sorted(d.model.node_id for d in found if d.model.address.startswith(DAGSTER_ADDRESS))


@pytest.fixture(scope="module")
def pg_deployment(
    etcd, spark_remote: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PgDeployment]:
    tmp = tmp_path_factory.mktemp("pg-deployment")
    settings = live_settings(tmp, "pg", etcd.endpoint, spark_remote, session_ttl=10.0)
    postgres = PostgresServer(tmp / "postgres")
    postgres.start()
    service = DagsterService(settings, dagster_home=tmp / "dagster_home", storage=postgres.storage_config())
    try:
        with running(service) as (url, store, producer):
            yield PgDeployment(url, settings, store, postgres, service, producer, tmp / "dagster_home")
    finally:
        postgres.stop()


def test_the_deployment_runs_on_postgres_and_a_kill_9_of_it_under_load_is_healed(
    pg_deployment: PgDeployment,
) -> None:
    """kill -9 of the Postgres postmaster while a producer writes and the sensors sync: the
    cluster's supervisor sees it down and starts it again on its data and port; the daemon
    and the webserver reconnect (or are restarted by the same supervisor), the syncs resume,
    every row is in the segments exactly once and no run is left holding a slot. The
    instance's dagster.yaml names Postgres: the sync runs, their materializations and the
    daemon's heartbeats are rows in its database, none in SQLite files; the webserver serves
    the same runs."""
    d = pg_deployment
    storage = Storage.from_settings(d.settings)
    # Created once both node sensors registered their nodes: created before, both channels
    # could go to the first node, and the balance then moved one (two runs more).
    wait_until(
        lambda: len(_dagster_nodes(d.store)) == d.settings.dagster_datanodes,
        180,
        "the Dagster-hosted DataNodes registered",
        describe=lambda: _dagster_nodes(d.store),
    )
    info = d.producer.create_collection(f"pgk{uuid.uuid4().hex[:6]}", SCHEMA, [], num_channels=2)
    supervisor = Supervisor(
        missing=lambda: d.postgres.missing() + d.service.missing(),
        heal=lambda: (d.postgres.start(), d.service.start()),
    )
    load = PausableLoad(d.producer, info, rows=40, period=0.2)
    load.start()
    try:
        wait_until(
            lambda: owners(d.store, list(info.vchannels)), after_a_run_start(60), "the channels watched"
        )
        with dg.DagsterInstance.from_config(str(d.home)) as instance:
            # Syncing: a sync run (a channel's first, its watch) or a node's sync loop run in
            # flight. The watch runs may be over by the time the channels are owned, and the
            # loops then sync every later change with no run of its own.
            wait_until(
                lambda: any(
                    instance.get_run_records(dg.RunsFilter(job_name=job, statuses=IN_FLIGHT))
                    for job in ("sync", LOOP_JOB)
                ),
                after_a_run_start(60),
                "a sync run or a sync loop run in flight",
            )
        port = d.postgres.port
        d.postgres.kill()
        # The daemon's health is read from the instance: with its server down, asked once
        # (Dagster would retry its connection for seconds at every look of the supervisor).
        daemon = d.service.recorded()
        assert daemon is not None
        assert "PostgreSQL does not answer" in daemon_state(daemon["pids"][0], d.home, time.time())
        assert "postgres" in supervisor.missing()
        supervisor.step()
        assert d.postgres.running() and d.postgres.port == port and supervisor.restarts
    finally:
        load.stop()
    d.producer.time_tick(info.name)
    wait_until(
        lambda: all_synced(d.store, storage, [info]),
        after_a_run_start(120),
        "every channel caught up after the kill",
    )
    tally = exactly_once(d.store, storage, info, load.produced)
    assert tally.ok, tally.describe()
    with dg.DagsterInstance.from_config(str(d.home)) as instance:
        wait_until(
            lambda: not instance.get_run_records(dg.RunsFilter(job_name="sync", statuses=IN_FLIGHT)),
            after_a_run_start(60),
            "no sync run left in flight",
        )
    supervisor.step()  # whatever the outage took down is healed
    assert supervisor.missing() == []
    daemon = d.service.recorded()
    assert daemon is not None
    wait_until(
        lambda: daemon_state(daemon["pids"][0], d.home, time.time()).startswith("up"),
        90,
        "the daemon's heartbeat in Postgres",
    )
    assert graphql(d.url, "{ version }")["version"]
    assert "postgres:" in (d.home / "dagster.yaml").read_text()
    assert not list(d.home.rglob("*.db")), "an SQLite file in the instance's home"
    # The runs that synced: sync runs, and the nodes' loop runs, which sync every change with
    # no run of its own (when they start before the channels are watched, no sync run at all).
    # Every run the webserver serves is a row of the database (read after it: a node's next
    # loop run may start in between).
    synced = 0
    for job in ("sync", LOOP_JOB):
        query = '{ runsOrError(filter: {pipelineName: "' + job + '"}) { ... on Runs { results { runId } } } }'
        served = {r["runId"] for r in graphql(d.url, query)["runsOrError"]["results"]}
        stored = {
            row[0] for row in _sql(d.postgres, f"SELECT run_id FROM runs WHERE pipeline_name = '{job}'")
        }
        assert served <= stored, (job, served - stored)
        synced += len(served)
    assert synced > 0
    ((materialized,),) = _sql(
        d.postgres, "SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'"
    )
    assert int(materialized) > 0  # type: ignore[call-overload]
    assert _sql(d.postgres, "SELECT count(*) FROM daemon_heartbeats")[0][0] > 0  # type: ignore[operator]
