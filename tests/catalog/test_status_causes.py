"""`vchan status` names the real cause of what needs attention: no active coordinator
(the Dagster daemon is down), or a dead Dagster service, instead of "the coordinator
should move it"."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.meta.session import Election
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, NodeSession, SessionState, VchannelInfo, WatchState
from vchan_assets.status import collect_status
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

from .helpers import SCHEMA

DEAD_NODE = 424242


def dead_owner_messages(system: System) -> list[str]:
    report = collect_status(Catalog(system), orphans=False)
    return [w["message"] for w in report["warnings"] if w["kind"] == "dead_owner"]


def test_a_channel_on_a_dead_node_with_no_active_coordinator_says_to_run_vchan_up(
    system: System, store: MetaStore, producer: Producer
) -> None:
    info = producer.create_collection(f"d{uuid.uuid4().hex[:6]}", SCHEMA, num_channels=1)
    (vchannel,) = info.vchannels
    watch = ChannelWatchInfo(
        vchan=VchannelInfo(info.id, vchannel),
        state=WatchState.WATCH_SUCCESS,
        start_ts=time.time(),
        timeout_ts=time.time() + 300,
    )
    store.put(store.keys.channel_watch(DEAD_NODE, vchannel), watch)

    (message,) = dead_owner_messages(system)
    assert "no DataCoord is active" in message and "run `vchan up`" in message

    record = NodeSession(77, "dagster:datacoord", "0", time.time(), SessionState.HEALTHY)
    election = Election(store, record, 30)
    assert election.try_acquire()
    try:
        (message,) = dead_owner_messages(system)
        assert "the active DataCoord (node 77 (the Dagster sensor)) moves it" in message
    finally:
        election.resign()


def test_a_dead_dagster_daemon_is_a_warning_that_says_to_run_vchan_up(
    system: System, settings: Settings
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the daemon was killed
    state = settings.home / "dagster" / "service.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"url": "http://127.0.0.1:1", "pids": [gone.pid, os.getpid()]}))

    report = collect_status(Catalog(system), orphans=False)

    assert report["services"] == {
        "dagster_daemon": f"down (pid {gone.pid} died)",
        "dagster_webserver": f"up (pid {os.getpid()})",
    }
    down = [w for w in report["warnings"] if w["kind"] == "service_down"]
    assert [w["service"] for w in down] == ["dagster_daemon"]
    assert "run `vchan up`" in down[0]["message"]
