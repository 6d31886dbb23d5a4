"""Resources: the system (etcd + storage + settings) and Spark, from the environment.

`VchanResource` has one field per row of the settings table (`config.VARIABLES`);
`from_env()` fills them with `EnvVar`s for every VCHAN_* variable that is set (the rest
keep the defaults of the settings table), so the UI shows where each value comes from and
nothing is hard-coded. Its behaviour lives in `VchanRuntime` (runtime.py), a plain class.

Spark goes through dagster-pyspark's `PySparkResource`. With VCHAN_SPARK_REMOTE set
(`vchan up` starts a local Spark Connect server and sets it) its session is a Spark
Connect client: a run pays ~1 s instead of ~9 s for a fresh JVM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
from dagster_pyspark import PySparkResource

from vchan_assets.config import VARIABLES, Settings
from vchan_assets.defs.runtime import VchanRuntime, open_runtime
from vchan_assets.spark.session import spark_conf


def _setting_fields() -> dict[str, Any]:
    """One optional text field per row of `config.VARIABLES`, named like its `Settings`
    field: the pydantic namespace (annotations and defaults) of `VchanResource`."""
    return {
        "__annotations__": {var.field: str | None for var in VARIABLES},
        **{var.field: None for var in VARIABLES},
    }


class VchanResource(dg.ConfigurableResource):
    """The vchan system: etcd, object storage, Spark and every other setting.

    Each field holds its variable's text as the environment would (None: the table's
    default); `Settings.from_env`, the one parser,
    validates them. Fields are text because Dagster's `EnvVar` supplies text only.
    """

    locals().update(_setting_fields())  # the fields, generated from the settings table

    @classmethod
    def from_env(cls) -> VchanResource:
        """An `EnvVar` for every VCHAN_* variable that is set, so the UI shows its source."""
        return cls(**{var.field: dg.EnvVar(var.name) for var in VARIABLES if os.environ.get(var.name)})

    @classmethod
    def from_settings(cls, settings: Settings) -> VchanResource:
        return cls(**{var.field: var.text(getattr(settings, var.field)) for var in VARIABLES})

    def settings(self) -> Settings:
        """The settings these fields describe (an unset field: the table's default),
        validated by `Settings.from_env` (ConfigError on a bad value)."""
        return Settings.from_env(
            {var.name: str(value) for var in VARIABLES if (value := getattr(self, var.field))}
        )

    @contextmanager
    def open(self) -> Iterator[VchanRuntime]:
        with open_runtime(self.settings()) as runtime:
            yield runtime


def pyspark_resource(settings: Settings) -> PySparkResource:
    """dagster-pyspark's resource, configured like `spark.session.get_spark`; the sync
    asset runs on its session. Nothing in the process environment changes."""
    if settings.spark_remote:
        return PySparkResource(spark_config={"spark.remote": settings.spark_remote})
    # Python workers must run this interpreter (it has vchan_assets), not `python3`.
    return PySparkResource(
        spark_config={
            "spark.master": settings.spark_master,
            **spark_conf(settings),
            "spark.pyspark.python": sys.executable,
        }
    )
