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
    instance: dg.DagsterInstance, op: str, stamps: Mapping[str, object], tags: Mapping[str, str] | None = None
) -> dg.RunRequest:
    """A request for a run of the one-op job `op` over the vchannels of `stamps` (each with
    what the sensor saw of it: a revision, a newest segment). The run key is derived from the
    stamps: the same vchannels in the same state are asked for once; a run that failed is
    asked for again up to twice (`retry_key`), for failures that changed nothing a sensor
    sees (a run whose process never started in time, or died)."""
    due = sorted(stamps)
    digest = hashlib.sha1(json.dumps({v: stamps[v] for v in due}).encode()).hexdigest()[:16]
    key = f"{op}-{digest}"
    return dg.RunRequest(
        run_key=retry_key(instance, key),
        run_config=dg.RunConfig(ops={op: VchannelsConfig(vchannels=due)}),
        tags=dict(tags or {}),
    )


def retry_key(instance: dg.DagsterInstance, run_key: str) -> str:
    """The run key, suffixed after failed runs that had it: a failed run (a sync whose Spark
    job was cancelled, a sort run failed by run monitoring because its process had not
    started within its start timeout) is asked for again, up to twice; a successful one
    never."""
    failed = instance.get_runs_count(
        dg.RunsFilter(tags={"dagster/run_key": run_key}, statuses=[dg.DagsterRunStatus.FAILURE])
    )
    if not failed:
        return run_key
    attempt = f"{run_key}:retry{failed}"
    again = instance.get_runs_count(
        dg.RunsFilter(tags={"dagster/run_key": attempt}, statuses=[dg.DagsterRunStatus.FAILURE])
    )
    return f"{run_key}:retry{failed + again}" if again else attempt
