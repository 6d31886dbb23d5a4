"""The DataCoord sensor: the same coordinator as `vchan datacoord`, hosted by sensor ticks.

- **One election.** Each tick campaigns in the election `vchan datacoord` processes use
  (`session/datacoord`): the sensor leads only while it holds the key, so a standalone
  coordinator and Dagster never coordinate at once. Its leadership lives on an etcd lease
  its ticks refresh (TTL max(VCHAN_SESSION_TTL, 60 s), as a sensor-hosted DataNode):
  stop the sensor (or kill the daemon) and a standby process takes over after the TTL.
- **One tick.** A term's first tick activates (`recover_flushing`, the meta reload); every
  tick then runs `DataCoordinator.tick`: channel reconcile (assign, reassign, balance),
  the seal policies and the periodic meta reload. Every write is fenced by the term.
- **Segment meta in memory.** The ticks share the code server process's segment cache
  (`shared_segment_cache`): loaded once, kept by its etcd watch, as fresh as a listing;
  the reloads, seals and summaries read it instead of listing every segment of etcd.
- **The cursor** (JSON) carries what a process keeps in memory: the contender's id, the
  term (lease and election key create revision), when meta was last reloaded and what it
  saw. A tick re-evaluated after a crash starts from what etcd says, like a standby.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import dagster as dg

from vchan_assets.datacoord.coordinator import CoordinatorTick, DataCoordinator
from vchan_assets.defs.cluster.cursor import SensorCursor
from vchan_assets.defs.cluster.datanodes import DAGSTER_ADDRESS, SESSION_TTL_FLOOR
from vchan_assets.defs.resources import VchanEnvResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.meta.errors import NotLeaderError
from vchan_assets.meta.segment_cache import shared_segment_cache
from vchan_assets.meta.session import Term, hold_term
from vchan_assets.meta.store import Fence

log = logging.getLogger(__name__)

COORDINATOR_SENSOR_INTERVAL = 1
COORDINATOR_ADDRESS = f"{DAGSTER_ADDRESS}datacoord"


@dataclass
class CoordinatorCursor(SensorCursor, afresh="campaigning afresh"):
    server_id: int = 0
    lease_id: int = 0
    create_revision: int = 0
    last_reload: float = 0.0
    seen: tuple[int, ...] = ()  # DataCoordinator.seen

    def term(self, key: str) -> Term | None:
        if not (self.lease_id and self.create_revision):
            return None
        return Term(self.lease_id, Fence(key, self.create_revision))


@dataclass
class CoordinatorStep:
    cursor: CoordinatorCursor
    tick: CoordinatorTick | None = None  # None: standing by
    why_idle: str = ""


def coordinate(
    runtime: VchanRuntime,
    cursor: CoordinatorCursor,
    now: float | None = None,
    min_session_ttl: float = SESSION_TTL_FLOOR,
) -> CoordinatorStep:
    """One sensor tick of the coordinator: hold (or win) the term, then the coordinator's tick."""
    settings = runtime.settings
    # Segment meta in memory, as `vchan datacoord` holds it: one copy for the code server's
    # process, kept by its own etcd watch between the ticks (meta/segment_cache.py).
    runtime.store.segment_cache = shared_segment_cache(settings, runtime.store.endpoints)
    coord = DataCoordinator(
        settings,
        runtime.store,
        address=COORDINATOR_ADDRESS,
        server_id=cursor.server_id or None,
    )
    idle = CoordinatorCursor(coord.server_id)
    record = coord.session_record(COORDINATOR_ADDRESS)
    ttl = max(settings.session_ttl, min_session_ttl)
    term, new = hold_term(runtime.store, coord.election.key, record, ttl, cursor.term(coord.election.key))
    if term is None:
        leader = coord.election.leader()
        return CoordinatorStep(
            idle, why_idle=f"standby: the election key is held by lease {leader and leader.lease}"
        )
    try:
        if new:
            coord.activate(term.fence)
        else:
            coord.begin_term(term.fence)
            assert coord.reloader is not None
            coord.reloader.seen, coord.last_reload = cursor.seen, cursor.last_reload
        tick = coord.tick(now)
    except NotLeaderError as exc:
        return CoordinatorStep(idle, why_idle=f"deposed mid-tick: {exc}")
    assert coord.reloader is not None
    done = CoordinatorCursor(
        coord.server_id, term.lease_id, term.fence.create_revision, coord.last_reload, coord.reloader.seen
    )
    recovered = tuple(coord.recovered) if new else ()
    return CoordinatorStep(done, CoordinatorTick(tick.channels, tick.sealed, tick.reloaded, recovered))


def describe(step: CoordinatorStep) -> str:
    if step.tick is None:
        return step.why_idle
    report = step.tick.channels
    parts = [f"live nodes {list(report.live_nodes)}"]
    parts += [f"assigned {v} -> {n}" for v, n in report.assigned]
    parts += [f"releasing {v} on {n} ({why})" for v, n, why in report.releasing]
    parts += [f"removed {v} on {n} ({why})" for v, n, why in report.removed]
    parts += [f"waiting: {v}" for v in report.remaining]
    parts += [f"sealed {s.segment_id} ({s.reason})" for s in step.tick.sealed]
    parts += [f"recovered {r.segment_id}: {r.action}" for r in step.tick.recovered]
    return "; ".join(parts)


def coordinator_sensor(min_session_ttl: float = SESSION_TTL_FLOOR) -> dg.SensorDefinition:
    """The DataCoord sensor (its term's lease TTL is at least `min_session_ttl`)."""

    @dg.sensor(
        name="datacoord_sensor",
        minimum_interval_seconds=COORDINATOR_SENSOR_INTERVAL,
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def _sensor(context: dg.SensorEvaluationContext, vchan_env: VchanEnvResource) -> dg.SensorResult:
        """DataCoord (elected, like `vchan datacoord`): assign channels to live DataNodes,
        reassign those of dead nodes, seal segments by policy, recover Flushing segments."""
        with vchan_env.open() as runtime:
            step = coordinate(
                runtime, CoordinatorCursor.parse(context.cursor), min_session_ttl=min_session_ttl
            )
        if step.tick is not None and (step.tick.channels.changed or step.tick.sealed or step.tick.recovered):
            context.log.info(describe(step))
        return dg.SensorResult(cursor=step.cursor.dump(), skip_reason=describe(step))

    return _sensor


datacoord_sensor = coordinator_sensor()
