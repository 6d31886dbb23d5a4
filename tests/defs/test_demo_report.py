"""The demo's asset-check report says which check failed on which vchannel, and which
vchannels ran no check at all (it said "no checks for []" when a check failed)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from vchan_assets.demo.via_dagster import DemoCheckError, _report_checks
from vchan_assets.model import CollectionInfo, CollectionSchema


def test_a_failed_check_is_named_with_its_vchannel_and_a_channel_without_checks_too() -> None:
    schema = CollectionSchema.build("pk", {"vec": 4}, {})
    info = CollectionInfo(id=1, name="c", schema=schema, partitions=(2,), vchannels=("v0", "v1", "v2"))
    checks = {
        ("v0", "checkpoint_monotonic"): False,
        ("v0", "no_duplicate_pks"): True,
        ("v1", "checkpoint_monotonic"): True,
        ("v1", "no_duplicate_pks"): True,
    }
    with pytest.raises(DemoCheckError) as failed:
        _report_checks(Console(file=io.StringIO()), info, checks)
    message = str(failed.value)
    assert "checkpoint_monotonic FAILED on v0" in message
    assert "no check ran for v2" in message
    assert "v1" not in message.split(":", 1)[1].split("the Dagster UI")[0]
