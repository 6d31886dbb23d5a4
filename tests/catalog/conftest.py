"""Fixtures of the catalog tests: known produced data and a catalog over it."""

from __future__ import annotations

import uuid

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.system import System

from .helpers import Known, produce_known


@pytest.fixture
def known(settings: Settings, store: MetaStore) -> Known:
    """A collection of known rows and deletes over 2 vchannels, synced and flushed."""
    storage = Storage.from_settings(settings)
    storage.ensure_root()
    return produce_known(store, storage, settings, f"books_{uuid.uuid4().hex[:6]}")[1]


@pytest.fixture
def catalog(settings: Settings, store: MetaStore) -> Catalog:
    return Catalog(System(settings, store, Storage.from_settings(settings)))
