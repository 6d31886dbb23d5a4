"""Spark: the session factory and the sync job's transformations."""

from typing import Literal

# Where a job's tasks run: on Spark (local, standalone or Connect), or in this process.
Engine = Literal["spark", "local"]
