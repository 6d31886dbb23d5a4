"""The lifecycle tests' collections have one vchannel (the `collection` fixture's)."""

import pytest


@pytest.fixture
def channels() -> int:
    return 1
