"""Asset check results and metadata for every asset, typed so the Dagster UI plots numbers.

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


def check_result(name: str, asset: dg.AssetKey, outcome: CheckOutcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=name,
        asset_key=asset,
        passed=outcome.passed,
        description=outcome.description,
        metadata=typed(outcome.metadata),
    )
