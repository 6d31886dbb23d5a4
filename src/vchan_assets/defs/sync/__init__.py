"""Dagster wiring of the sync of a vchannel: its assets, checks, job and sensor."""
