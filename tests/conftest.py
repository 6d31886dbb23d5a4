"""Shared fixtures: a real etcd server, real storage directories, real Spark.

Nothing here fakes a component: `etcd` is the etcd binary on a loopback port,
storage is a temporary directory (or a real S3-compatible server in the S3 tests).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One etcd server for the whole run; tests isolate themselves by key root."""
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd-shared")).start()
    yield server
    server.stop()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd server of this test alone: for tests that restart, kill or compact it."""
    server = EmbeddedEtcd(tmp_path / "etcd").start()
    yield server
    server.stop()


@pytest.fixture
def settings(etcd: EmbeddedEtcd, tmp_path: Path) -> Settings:
    """Settings of one test: its own key root and storage directory on the shared etcd."""
    return replace(
        Settings(),
        home=tmp_path / "home",
        root=f"test-{uuid.uuid4().hex[:12]}",
        etcd_endpoints=(etcd.endpoint,),
        storage_uri=str(tmp_path / "storage"),
        etcd_timeout=5.0,
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[MetaStore]:
    meta = MetaStore.connect(settings)
    yield meta
    meta.close()
