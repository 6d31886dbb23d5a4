"""Fixtures of the Dagster-layer tests: a real etcd (shared, from tests/conftest.py), a
real local Spark Connect server for the session, a collection with produced data, and
Dagster's own ephemeral instance."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest

from vchan_assets.config import Settings
from vchan_assets.defs.resources import VchanResource
from vchan_assets.defs.runtime import VchanRuntime
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.steps import new_collection
from vchan_assets.wal.producer import Producer

from .helpers import SCHEMA


@pytest.fixture
def dsettings(settings: Settings, spark_remote: str) -> Settings:
    """Test settings with short timeouts and Spark Connect."""
    storage = Path(settings.storage_uri)
    storage.mkdir(parents=True, exist_ok=True)
    return replace(settings, spark_remote=spark_remote, session_ttl=2.0, watch_timeout=30.0, sync_max_age=1.0)


@pytest.fixture
def vchan(dsettings: Settings) -> VchanResource:
    return VchanResource.from_settings(dsettings)


@pytest.fixture
def system(dsettings: Settings, store: MetaStore, storage: Storage) -> System:
    """The test's `System` on `dsettings` (the `producer` fixture's too)."""
    return System(dsettings, store, storage)


@pytest.fixture
def runtime(system: System) -> VchanRuntime:
    return VchanRuntime(system.settings, system.store, system.storage)


@pytest.fixture
def collection(producer: Producer) -> CollectionInfo:
    return new_collection(producer, schema=SCHEMA)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst
