"""Fixtures of the catalog tests: known produced data and a catalog over it."""

from __future__ import annotations

import uuid

import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.system import System

from .helpers import Known, produce_known


@pytest.fixture
def known(system: System) -> Known:
    """A collection of known rows and deletes over 2 vchannels, synced and flushed."""
    return produce_known(system, f"books_{uuid.uuid4().hex[:6]}")[1]


@pytest.fixture
def catalog(system: System) -> Catalog:
    return Catalog(system)
