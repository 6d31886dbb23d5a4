"""Dagster wiring of the cluster roles: DataNode watch sensors and the DataCoord sensor."""
