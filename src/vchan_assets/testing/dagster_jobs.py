"""A Dagster job that does nothing: a run for the tests and benchmarks of an instance's
storage and history to record, keep or delete."""

import dagster as dg


@dg.op
def noop() -> None:
    """Nothing."""


@dg.job
def one_op() -> None:
    noop()
