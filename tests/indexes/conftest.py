from __future__ import annotations

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System


@pytest.fixture
def system(settings: Settings, store: MetaStore, storage: Storage) -> System:
    return System(settings, store, storage)
