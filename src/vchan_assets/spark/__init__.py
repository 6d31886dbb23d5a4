"""Spark: the session factory and the sync job's transformations."""
