"""Asset check results and metadata for every asset, typed so the Dagster UI plots numbers.

Exactly-once checks are declared `blocking` (`asset_checks(..., blocking=True)`).

Every number an asset records (rows, bytes, lag, seconds) goes out as `MetadataValue.int` or
`MetadataValue.float`: the asset's Plots tab then draws it over time, per partition.
"""

from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

import dagster as dg

from vchan_assets.datanode.checks import CheckOutcome


def typed(values: Mapping[str, Any]) -> dict[str, dg.MetadataValue]:
    """bool, int, float and str values as their typed MetadataValue (bool before int:
    a bool is an int in Python); anything else as text."""
    out: dict[str, dg.MetadataValue] = {}
    for key, value in values.items():
        if isinstance(value, dg.MetadataValue):
            out[key] = value
        elif isinstance(value, bool):
            out[key] = dg.MetadataValue.bool(value)
        elif isinstance(value, int):
            out[key] = dg.MetadataValue.int(value)
        elif isinstance(value, float):
            out[key] = dg.MetadataValue.float(value)
        else:
            out[key] = dg.MetadataValue.text(str(value))
    return out


def asset_checks(
    asset: dg.AssetKey, *, blocking: bool = False, **descriptions: str
) -> tuple[dg.AssetCheckSpec, ...]:
    """The checks of one asset, declared as check name = description, in that order.

    `blocking`: the checks guard exactly-once (no row lost or duplicated, no file missing):
    a failure (severity ERROR) stops the downstream work. In the run, Dagster does not
    start the steps of downstream assets; across runs, declarative automation waits
    while a blocking check of a dependency failed (`segment_table`'s condition,
    defs/automation.py), and the UI marks the check as blocking."""
    return tuple(
        dg.AssetCheckSpec(name, asset=asset, description=text, blocking=blocking)
        for name, text in descriptions.items()
    )


def check_result(check: dg.AssetCheckSpec, outcome: CheckOutcome) -> dg.AssetCheckResult:
    """The outcome of `check` as Dagster's result; its asset and name come from the spec
    the asset declared, so they cannot be paired wrongly."""
    return dg.AssetCheckResult(
        check_name=check.name,
        asset_key=check.asset_key,
        passed=outcome.passed,
        description=outcome.description,
        metadata=typed(outcome.metadata),
    )


# What an op that is not the asset's own (the sync loop, the query view run) reports of it.
ReportedEvent = dg.AssetMaterialization | dg.AssetCheckEvaluation


def reported_events(
    results: list[dg.MaterializeResult | dg.AssetCheckResult], partition: str
) -> list[ReportedEvent]:
    """Results an asset would return (its materializations and check results, each naming
    its asset) as the events an op reports for `partition`: the asset's history and checks
    are the same whether the asset's run or another op made them."""
    events: list[ReportedEvent] = []
    for r in results:
        assert r.asset_key is not None  # the results name their asset
        if isinstance(r, dg.MaterializeResult):
            events.append(dg.AssetMaterialization(r.asset_key, partition=partition, metadata=r.metadata))
        else:
            assert r.check_name is not None
            events.append(
                dg.AssetCheckEvaluation(
                    asset_key=r.asset_key,
                    check_name=r.check_name,
                    passed=r.passed,
                    metadata=r.metadata,
                    description=r.description,
                    partition=partition,
                )
            )
    return events


# What the asset of one vchannel returns: its materialization and its check results.
VchannelResults = tuple[dg.MaterializeResult, list[dg.AssetCheckResult]]


def report_each_vchannel(
    log: dg.DagsterLogManager,
    vchannels: Sequence[str],
    live: Container[str],
    results: Callable[[str], VchannelResults],
    what: str,
) -> Iterator[ReportedEvent]:
    """The events of `results(vchannel)` for each of `vchannels` in turn, as the op of a run
    that serves many partitions reports them (the view run, the sort run). A vchannel no
    longer `live` (dropped meanwhile) is skipped. One whose results raise does not keep the
    others from being reported: the op fails at the end, naming each such vchannel and why
    (`what`: "the view", "the sort", for the messages)."""
    failed: dict[str, str] = {}
    for vchannel in vchannels:
        if vchannel not in live:
            log.info(f"{vchannel} is not a vchannel any more: {what} is skipped")
            continue
        try:
            materialized, checks = results(vchannel)
        except Exception as exc:  # any reason: the next vchannels are still reported
            log.error(f"{vchannel}: {what} failed: {exc}")
            failed[vchannel] = f"{type(exc).__name__}: {exc}"
            continue
        yield from reported_events([materialized, *checks], vchannel)
    if failed:
        raise dg.Failure(
            f"{what} of {len(failed)} of {len(vchannels)} vchannels failed (the others were reported)",
            metadata={v: dg.MetadataValue.text(why) for v, why in failed.items()},
        )
