"""One optimistic-retry helper: re-read and retry on a lost compare-and-swap, then give up
with an error of its own that names what was being written."""

from __future__ import annotations

import pytest

from vchan_assets.meta.codec import decode_dict
from vchan_assets.meta.errors import CasConflictError, RetriesExhaustedError
from vchan_assets.meta.retry import retry_on_conflict
from vchan_assets.meta.store import MetaStore


def test_a_write_that_lost_a_race_is_retried_against_the_new_value(store: MetaStore) -> None:
    key = store.keys.channel_checkpoint("retry-a")
    store.cas(key, 0, {"n": 0})
    read: list[int] = []

    def increment() -> int:
        kv = store.get(key)
        assert kv is not None
        n = decode_dict(key, kv.value)["n"]
        if not read:  # a rival writes between our read and our swap, once
            store.cas(key, kv.version, {"n": 10})
        read.append(n)
        store.cas(key, kv.version, {"n": n + 1})
        return int(n) + 1

    assert retry_on_conflict("counter", increment) == 11
    assert read == [0, 10]


def test_every_attempt_lost_raises_retries_exhausted_naming_the_write(store: MetaStore) -> None:
    key = store.keys.channel_checkpoint("retry-b")
    store.cas(key, 0, {"n": 0})
    seen: list[CasConflictError] = []

    def stale_write() -> None:
        store.cas(key, 0, {"n": 1})  # "create if absent" on a key that exists: always loses

    with pytest.raises(RetriesExhaustedError) as gave_up:
        retry_on_conflict("checkpoint of retry-b", stale_write, attempts=3, on_conflict=seen.append)

    assert gave_up.value.attempts == 3 and len(seen) == 3
    assert "checkpoint of retry-b" in str(gave_up.value) and key in str(gave_up.value)
    assert gave_up.value.last.key == key
