"""Resources: the system (etcd + storage + settings) and Spark, from the environment.

`VchanResource` has one field per setting the Dagster layer needs (numbers as text,
parsed and validated by `Settings.from_env`); `from_env()`
fills them with `EnvVar`s for every VCHAN_* variable that is set (the rest keep the
defaults of `config.py`), so the UI shows where each value comes from and nothing is
hard-coded. Its behaviour lives in `VchanRuntime` (runtime.py), a plain class.

Spark goes through dagster-pyspark's `PySparkResource`. With VCHAN_SPARK_REMOTE set
(`vchan up` starts a local Spark Connect server and sets it) its session is a Spark
Connect client: a run pays ~1 s instead of ~9 s for a fresh JVM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg
from dagster_pyspark import PySparkResource

from vchan_assets.config import Settings
from vchan_assets.defs.runtime import VchanRuntime, open_runtime
from vchan_assets.spark.session import spark_conf

# field name -> environment variable
ENV_FIELDS = {
    "home": "VCHAN_HOME",
    "root": "VCHAN_ROOT",
    "etcd_endpoints": "VCHAN_ETCD_ENDPOINTS",
    "storage_uri": "VCHAN_STORAGE_URI",
    "spark_master": "VCHAN_SPARK_MASTER",
    "spark_remote": "VCHAN_SPARK_REMOTE",
    "session_ttl": "VCHAN_SESSION_TTL",
    "watch_timeout": "VCHAN_WATCH_TIMEOUT",
    "sync_buffer_mb": "VCHAN_SYNC_BUFFER_MB",
    "sync_max_age": "VCHAN_SYNC_MAX_AGE",
}


class VchanResource(dg.ConfigurableResource):
    """The vchan system: etcd key root and endpoints, object storage, Spark."""

    home: str = ".vchan"
    root: str = "vchan"
    etcd_endpoints: str | None = None  # host:port,...; None: the embedded etcd under home
    storage_uri: str | None = None  # None: $home/storage
    spark_master: str = "local[*]"
    spark_remote: str | None = None  # sc://host:port: Spark Connect
    session_ttl: str | None = None  # seconds; None: config.py's default
    watch_timeout: str | None = None
    sync_buffer_mb: str | None = None
    sync_max_age: str | None = None

    @classmethod
    def from_env(cls) -> VchanResource:
        values: dict[str, Any] = {
            name: dg.EnvVar(var) for name, var in ENV_FIELDS.items() if os.environ.get(var)
        }
        return cls(**values)

    @classmethod
    def from_settings(cls, settings: Settings) -> VchanResource:
        return cls(
            home=str(settings.home),
            root=settings.root,
            etcd_endpoints=",".join(settings.etcd_endpoints) if settings.etcd_endpoints else None,
            storage_uri=settings.storage_uri,
            spark_master=settings.spark_master,
            spark_remote=settings.spark_remote,
            session_ttl=str(settings.session_ttl),
            watch_timeout=str(settings.watch_timeout),
            sync_buffer_mb=str(settings.sync_buffer_mb),
            sync_max_age=str(settings.sync_max_age),
        )

    def settings(self) -> Settings:
        """Every other setting from the process environment, these fields over it;
        validated by `Settings.from_env` (ConfigError on a bad value)."""
        env = dict(os.environ)
        for name, var in ENV_FIELDS.items():
            value = getattr(self, name)
            if value:
                env[var] = str(value)
            else:
                env.pop(var, None)
        base = Settings.from_env(env)
        return replace(base, home=Path(base.home))

    @contextmanager
    def open(self) -> Iterator[VchanRuntime]:
        with open_runtime(self.settings()) as runtime:
            yield runtime


def pyspark_resource(settings: Settings) -> PySparkResource:
    """dagster-pyspark's resource, configured like `spark.session.get_spark` so the sync
    task (which calls get_spark) gets the same session (getOrCreate)."""
    # Python workers must run this interpreter (it has vchan_assets), as get_spark ensures.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if settings.spark_remote:
        return PySparkResource(spark_config={"spark.remote": settings.spark_remote})
    return PySparkResource(spark_config={"spark.master": settings.spark_master, **spark_conf(settings)})
