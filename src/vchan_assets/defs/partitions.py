"""One dynamic partition per vchannel, added when a channel is first watched (or synced)."""

from __future__ import annotations

import dagster as dg

VCHANNELS = "vchannels"
vchannels = dg.DynamicPartitionsDefinition(name=VCHANNELS)


class VchannelsConfig(dg.Config):
    """The vchannels (partitions) a run that serves many of them works on: a sort run, a
    view run."""

    vchannels: list[str]
