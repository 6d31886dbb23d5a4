"""Checks shared by the cluster tests."""

from __future__ import annotations

from collections.abc import Callable

from vchan_assets.meta.store import MetaStore
from vchan_assets.model import MsgPosition
from vchan_assets.testing.harness import checkpoint_of

# How long a cluster condition may take to hold on a loaded 2-core machine (JVMs, three etcd
# members and the processes under test share it). wait_until returns as soon as it holds,
# so a generous bound costs nothing when things go well.
PATIENCE = 180


def checkpoints(store: MetaStore, channels: list[str]) -> dict[str, MsgPosition | None]:
    return {v: checkpoint_of(store, v) for v in channels}


def advanced(store: MetaStore, before: dict[str, MsgPosition | None]) -> Callable[[], bool]:
    """A condition: every channel's checkpoint is past where `before` saw it."""

    def check() -> bool:
        for vchannel, old in before.items():
            now = checkpoint_of(store, vchannel)
            if now is None or (old is not None and now.offset <= old.offset):
                return False
        return True

    return check
