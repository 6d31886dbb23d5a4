"""One dynamic partition per vchannel, added when a channel is first watched (or synced)."""

from __future__ import annotations

import dagster as dg

VCHANNELS = "vchannels"
vchannels = dg.DynamicPartitionsDefinition(name=VCHANNELS)
