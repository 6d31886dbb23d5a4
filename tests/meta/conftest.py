"""Fixtures of the metastore tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vchan_assets.config import Settings

from .helpers import ChildNode


@pytest.fixture
def spawn_node(settings: Settings) -> Iterator[Callable[..., ChildNode]]:
    """Start child node processes on the test's etcd and key root; all killed at the end."""
    children: list[ChildNode] = []
    assert settings.etcd_endpoints is not None
    endpoint = settings.etcd_endpoints[0]

    def spawn(mode: str, node_id: int, ttl: float, marker: Path | None = None) -> ChildNode:
        child = ChildNode([mode, endpoint, settings.root, str(node_id), str(ttl), str(marker or "-")])
        children.append(child)
        return child

    yield spawn
    for child in children:
        child.cleanup()
