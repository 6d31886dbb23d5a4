"""Bulk import in Dagster: the `imported_segments` asset, its job and sensor."""
