"""One dynamic partition per vchannel, added when a channel is first watched (or synced)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import dagster as dg

VCHANNELS = "vchannels"
vchannels = dg.DynamicPartitionsDefinition(name=VCHANNELS)


class VchannelsConfig(dg.Config):
    """The vchannels (partitions) a run that serves many of them works on: a sort run, a
    view run."""

    vchannels: list[str]


def vchannels_run_request(
    op: str, stamps: Mapping[str, object], tags: Mapping[str, str] | None = None
) -> dg.RunRequest:
    """A request for a run of the one-op job `op` over the vchannels of `stamps` (each with
    what the sensor saw of it: a revision, a newest segment). The run key is derived from the
    stamps: the same vchannels in the same state are asked for once, a run that failed is not
    repeated until one of them changes."""
    due = sorted(stamps)
    digest = hashlib.sha1(json.dumps({v: stamps[v] for v in due}).encode()).hexdigest()[:16]
    return dg.RunRequest(
        run_key=f"{op}-{digest}",
        run_config=dg.RunConfig(ops={op: VchannelsConfig(vchannels=due)}),
        tags=dict(tags or {}),
    )
