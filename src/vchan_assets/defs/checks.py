"""A domain check's outcome as a Dagster asset check result (one place for every asset)."""

import dagster as dg

from vchan_assets.datanode.checks import CheckOutcome


def check_result(name: str, asset: dg.AssetKey, outcome: CheckOutcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=name,
        asset_key=asset,
        passed=outcome.passed,
        description=outcome.description,
        metadata=dict(outcome.metadata),
    )
