"""Steps of the coordination tests: DataNode sessions the test answers for, as a node would."""

from __future__ import annotations

import time

from vchan_assets import __version__
from vchan_assets.config import Settings
from vchan_assets.datanode.channel import NodeContext
from vchan_assets.datanode.node import release_channel, watch_channel
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import ChannelWatchInfo, NodeSession, SessionState, WatchState
from vchan_assets.storage import Storage
from vchan_assets.system import System


class Sessions:
    """DataNode sessions registered in this process (no node loop: the test answers for
    them), in the state and with the package version a test needs."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self.held: dict[int, Session] = {}

    def up(
        self,
        node_id: int,
        state: SessionState = SessionState.HEALTHY,
        version: str = __version__,
        ttl: float = 30,
    ) -> int:
        record = NodeSession(node_id, "", version, time.time(), state, time.time())
        self.held[node_id] = Session.for_datanode(self.store, record, ttl=ttl).register()
        return node_id

    def enter(self, node_id: int, state: SessionState, since: float | None = None) -> None:
        session = self.held[node_id]
        assert isinstance(session.value, NodeSession)
        session.update(session.value.entered(state, since))

    def down(self, node_id: int) -> None:
        self.held.pop(node_id).close()

    def close(self) -> None:
        for s in self.held.values():
            s.close()


def node_system(store: MetaStore, settings: Settings) -> System:
    return System(settings, store, Storage.from_settings(settings))


def answer(store: MetaStore, settings: Settings, node_id: int) -> None:
    """What a node does with its ToWatch/ToRelease infos (no channel work started)."""
    ctx = NodeContext(node_system(store, settings), node_id)
    for kv in store.list_prefix(store.keys.channel_watch.under(node_id)).items:
        found = store.get_model(kv.key, ChannelWatchInfo)
        assert found is not None
        if found.model.state is WatchState.TO_WATCH:
            watch_channel(ctx, kv.key, kv.version, found.model)
        elif found.model.state is WatchState.TO_RELEASE:
            release_channel(ctx, kv.key, kv.version, found.model)
