from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.testing.harness import Cluster, fast_settings

from .helpers import Sessions


@pytest.fixture
def private_cluster(private_settings: Settings, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(fast_settings(private_settings), tmp_path)
    yield c
    c.cleanup()


@pytest.fixture
def nodes(store: MetaStore) -> Iterator[Sessions]:
    """DataNode sessions the test registers and answers for."""
    n = Sessions(store)
    yield n
    n.close()
