"""Settings of the whole system, read once from the environment and passed down.

Every variable is listed in `VARIABLES` with its default and meaning; the README's
configuration table is checked against it. A wrong value raises `ConfigError`
naming the variable and what was expected, before anything starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting has a value the system cannot use."""

    def __init__(self, variable: str, value: str, expected: str) -> None:
        super().__init__(f"{variable}={value!r} is invalid: expected {expected}")
        self.variable = variable
        self.value = value
        self.expected = expected


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "a number") from None
    if not math.isfinite(value):
        raise ConfigError(name, raw, "a finite number")
    if value <= 0:
        raise ConfigError(name, raw, "a number greater than 0")
    return value


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, raw, "a whole number") from None
    if value <= 0:
        raise ConfigError(name, raw, "a whole number greater than 0")
    return value


def _proportion(name: str, raw: str) -> float:
    value = _positive_float(name, raw)
    if value > 1:
        raise ConfigError(name, raw, "a proportion in (0, 1]")
    return value


def _endpoints(name: str, raw: str) -> tuple[str, ...]:
    endpoints = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not endpoints:
        raise ConfigError(name, raw, "a comma-separated list of host:port")
    for endpoint in endpoints:
        host, sep, port = endpoint.removeprefix("http://").removeprefix("https://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(name, raw, "a comma-separated list of host:port (port 1-65535)")
    return endpoints


def _existing_file(name: str, raw: str) -> str:
    if not Path(raw).is_file():
        raise ConfigError(name, raw, "the path of a readable file")
    return raw


def _storage_uri(name: str, raw: str) -> str:
    if "://" in raw and not raw.startswith(("s3://", "file://")):
        raise ConfigError(name, raw, "a local path, file://path or s3://bucket/prefix")
    if raw.startswith("s3://") and not raw.removeprefix("s3://").strip("/"):
        raise ConfigError(name, raw, "s3://bucket/prefix with a bucket name")
    return raw


def _spark_remote(name: str, raw: str) -> str:
    if not raw.startswith("sc://") or not raw.removeprefix("sc://").strip("/"):
        raise ConfigError(name, raw, "a Spark Connect URL such as sc://localhost:15002")
    return raw


def _root(name: str, raw: str) -> str:
    root = raw.strip("/")
    if not root or any(c.isspace() for c in root):
        raise ConfigError(name, raw, "a non-empty key prefix without spaces")
    return root


def _text(name: str, raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Variable:
    name: str
    default: str | None
    parse: Callable[[str, str], Any]
    help: str


# One row per environment variable: (name, default, parser, meaning).
VARIABLES: tuple[Variable, ...] = (
    Variable("VCHAN_HOME", ".vchan", _text, "directory of the embedded stack (etcd data, storage)"),
    Variable("VCHAN_ROOT", "vchan", _root, "root prefix of every etcd key"),
    Variable(
        "VCHAN_ETCD_ENDPOINTS", None, _endpoints, "host:port,... of an etcd cluster; unset: embedded etcd"
    ),
    Variable("VCHAN_ETCD_USER", None, _text, "etcd user (with VCHAN_ETCD_PASSWORD)"),
    Variable("VCHAN_ETCD_PASSWORD", None, _text, "etcd password"),
    Variable("VCHAN_ETCD_CA_CERT", None, _existing_file, "CA certificate: enables TLS to etcd"),
    Variable("VCHAN_ETCD_CERT", None, _existing_file, "client certificate for etcd TLS"),
    Variable("VCHAN_ETCD_KEY", None, _existing_file, "client key for etcd TLS"),
    Variable("VCHAN_ETCD_TIMEOUT", "5", _positive_float, "seconds before an etcd call fails"),
    Variable("VCHAN_STORAGE_URI", None, _storage_uri, "object storage root; default $VCHAN_HOME/storage"),
    Variable(
        "VCHAN_S3_ENDPOINT", None, _text, "endpoint override for S3-compatible servers (http://host:port)"
    ),
    Variable("VCHAN_S3_REGION", "us-east-1", _text, "S3 region"),
    Variable("VCHAN_SPARK_MASTER", "local[*]", _text, "Spark master URL"),
    Variable(
        "VCHAN_SPARK_REMOTE", None, _spark_remote, "Spark Connect URL (sc://host:port); wins over the master"
    ),
    Variable("VCHAN_SESSION_TTL", "10", _positive_float, "seconds a node session lives without keep-alive"),
    Variable(
        "VCHAN_WATCH_TIMEOUT",
        "300",
        _positive_float,
        "seconds before a stuck ToWatch/ToRelease is reassigned",
    ),
    Variable("VCHAN_TICKLER_INTERVAL", "15", _positive_float, "seconds between watch progress updates"),
    Variable("VCHAN_SEGMENT_MAX_SIZE_MB", "1024", _positive_float, "segment size at which it is sealed"),
    Variable(
        "VCHAN_SEGMENT_SEAL_PROPORTION",
        "0.12",
        _proportion,
        "growing-segment share of max size that may be sealed early",
    ),
    Variable(
        "VCHAN_SEGMENT_MAX_LIFE", "86400", _positive_float, "seconds after which a growing segment is sealed"
    ),
    Variable(
        "VCHAN_SEGMENT_MAX_IDLE",
        "600",
        _positive_float,
        "seconds without inserts after which a segment is sealed",
    ),
    Variable("VCHAN_SYNC_BUFFER_MB", "16", _positive_float, "buffered log data that triggers a sync"),
    Variable(
        "VCHAN_SYNC_MAX_AGE",
        "600",
        _positive_float,
        "age in seconds of the oldest unsynced row that triggers a sync",
    ),
    Variable("VCHAN_TIMETICK_LAG_WARN", "120", _positive_float, "seconds of time-tick lag before a warning"),
    Variable("VCHAN_GC_INTERVAL", "3600", _positive_float, "seconds between garbage collections"),
    Variable(
        "VCHAN_GC_MISSING_TOLERANCE", "86400", _positive_float, "seconds before an orphan file is removed"
    ),
    Variable(
        "VCHAN_GC_DROP_TOLERANCE",
        "10800",
        _positive_float,
        "seconds before a dropped segment's files are removed",
    ),
    Variable("VCHAN_SPARK_PARTITIONS", "2", _positive_int, "Spark tasks per sync job"),
    Variable(
        "VCHAN_DAGSTER_DATANODES", "2", _positive_int, "DataNodes hosted by Dagster sensors (datanode_1..N)"
    ),
)


@dataclass(frozen=True)
class Settings:
    home: Path = Path(".vchan")
    root: str = "vchan"
    etcd_endpoints: tuple[str, ...] | None = None
    etcd_user: str | None = None
    etcd_password: str | None = None
    etcd_ca_cert: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_timeout: float = 5.0
    storage_uri: str = ".vchan/storage"
    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    spark_master: str = "local[*]"
    spark_remote: str | None = None
    session_ttl: float = 10.0
    watch_timeout: float = 300.0
    tickler_interval: float = 15.0
    segment_max_size_mb: float = 1024.0
    segment_seal_proportion: float = 0.12
    segment_max_life: float = 86400.0
    segment_max_idle: float = 600.0
    sync_buffer_mb: float = 16.0
    sync_max_age: float = 600.0
    timetick_lag_warn: float = 120.0
    gc_interval: float = 3600.0
    gc_missing_tolerance: float = 86400.0
    gc_drop_tolerance: float = 10800.0
    spark_partitions: int = 2
    dagster_datanodes: int = 2

    @property
    def embedded_etcd(self) -> bool:
        return self.etcd_endpoints is None

    @property
    def etcd_dir(self) -> Path:
        return self.home / "etcd"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every VCHAN_* variable; raise ConfigError on the first bad one."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for var in VARIABLES:
            raw = env.get(var.name)
            if raw is None or raw == "":
                if var.default is None:
                    continue
                raw = var.default
            values[var.name] = var.parse(var.name, raw)
        if ("VCHAN_ETCD_USER" in values) != ("VCHAN_ETCD_PASSWORD" in values):
            missing = "VCHAN_ETCD_PASSWORD" if "VCHAN_ETCD_USER" in values else "VCHAN_ETCD_USER"
            raise ConfigError(missing, "", "set together with its pair (user and password)")
        if ("VCHAN_ETCD_CERT" in values) != ("VCHAN_ETCD_KEY" in values):
            missing = "VCHAN_ETCD_KEY" if "VCHAN_ETCD_CERT" in values else "VCHAN_ETCD_CERT"
            raise ConfigError(missing, "", "set together with its pair (certificate and key)")
        home = Path(values["VCHAN_HOME"]).absolute()
        storage = values.get("VCHAN_STORAGE_URI") or str(home / "storage")
        if not storage.startswith("s3://"):
            storage = str(Path(storage.removeprefix("file://")).absolute())
        return cls(
            home=home,
            root=values["VCHAN_ROOT"],
            etcd_endpoints=values.get("VCHAN_ETCD_ENDPOINTS"),
            etcd_user=values.get("VCHAN_ETCD_USER"),
            etcd_password=values.get("VCHAN_ETCD_PASSWORD"),
            etcd_ca_cert=values.get("VCHAN_ETCD_CA_CERT"),
            etcd_cert=values.get("VCHAN_ETCD_CERT"),
            etcd_key=values.get("VCHAN_ETCD_KEY"),
            etcd_timeout=values["VCHAN_ETCD_TIMEOUT"],
            storage_uri=storage,
            s3_endpoint=values.get("VCHAN_S3_ENDPOINT"),
            s3_region=values["VCHAN_S3_REGION"],
            spark_master=values["VCHAN_SPARK_MASTER"],
            spark_remote=values.get("VCHAN_SPARK_REMOTE"),
            session_ttl=values["VCHAN_SESSION_TTL"],
            watch_timeout=values["VCHAN_WATCH_TIMEOUT"],
            tickler_interval=values["VCHAN_TICKLER_INTERVAL"],
            segment_max_size_mb=values["VCHAN_SEGMENT_MAX_SIZE_MB"],
            segment_seal_proportion=values["VCHAN_SEGMENT_SEAL_PROPORTION"],
            segment_max_life=values["VCHAN_SEGMENT_MAX_LIFE"],
            segment_max_idle=values["VCHAN_SEGMENT_MAX_IDLE"],
            sync_buffer_mb=values["VCHAN_SYNC_BUFFER_MB"],
            sync_max_age=values["VCHAN_SYNC_MAX_AGE"],
            timetick_lag_warn=values["VCHAN_TIMETICK_LAG_WARN"],
            gc_interval=values["VCHAN_GC_INTERVAL"],
            gc_missing_tolerance=values["VCHAN_GC_MISSING_TOLERANCE"],
            gc_drop_tolerance=values["VCHAN_GC_DROP_TOLERANCE"],
            spark_partitions=values["VCHAN_SPARK_PARTITIONS"],
            dagster_datanodes=values["VCHAN_DAGSTER_DATANODES"],
        )
