"""Fixtures of the index tests."""

from __future__ import annotations

import pytest

from vchan_assets.testing.index_data import Data, new_data
from vchan_assets.wal.producer import Producer


@pytest.fixture
def data(producer: Producer) -> Data:
    """A new collection of the index tests' schema (16-d vectors), one vchannel, nothing
    inserted yet (modules whose tests share filled data have a `data` of their own)."""
    return new_data(producer)
