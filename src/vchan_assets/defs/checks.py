"""Asset check results and metadata for every asset, typed so the Dagster UI plots numbers.

Exactly-once checks are declared `blocking` (`asset_checks(..., blocking=True)`).

Every number an asset records (rows, bytes, lag, seconds) goes out as `MetadataValue.int` or
`MetadataValue.float`: the asset's Plots tab then draws it over time, per partition.
"""

from collections.abc import Mapping
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
