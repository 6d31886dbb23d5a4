"""Settings of the whole system, read once from the environment and passed down.

Each variable is declared once, on its `Settings` field (`setting(name, default,
parser, meaning)`); `VARIABLES` is that table. `Settings.from_env` parses it, `to_env`
writes it back for child processes, the Dagster resource takes one field per row, and
the README's configuration table is generated from it (`readme_table`). A wrong value raises `ConfigError`
naming the variable and what was expected, before anything starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from vchan_assets.errors import DeclaredError


class ConfigError(DeclaredError, ValueError):
    """A setting has a value the system cannot use."""

    variable: str
    value: str
    expected: str
    message = "{variable}={value!r} is invalid: expected {expected}"


def _finite_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "a number") from None
    if not math.isfinite(value):
        raise ConfigError(name, raw, "a finite number")
    return value


def _positive_float(name: str, raw: str) -> float:
    value = _finite_float(name, raw)
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


def _non_negative_float(name: str, raw: str) -> float:
    value = _finite_float(name, raw)
    if value < 0:
        raise ConfigError(name, raw, "a number of at least 0")
    return value


def _proportion(name: str, raw: str) -> float:
    value = _positive_float(name, raw)
    if value > 1:
        raise ConfigError(name, raw, "a proportion in (0, 1]")
    return value


def _factor(name: str, raw: str) -> float:
    value = _positive_float(name, raw)
    if value < 1:
        raise ConfigError(name, raw, "a factor of at least 1")
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


# --- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variable:
    """One environment variable: the `Settings` field it fills, how its text is parsed,
    its default (None: unset) and its meaning. Declared once, on the `Settings` field."""

    name: str
    field: str
    default: Any
    parse: Callable[[str, str], Any]
    doc: str
    shown_default: str | None = None  # the README's default column, where it is derived

    def text(self, value: Any) -> str | None:
        """`value` as the environment writes it (None: leave the variable unset)."""
        return _as_text(value)

    @property
    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        text = _as_text(self.default)
        return "unset" if text is None else f"`{text}`"


def _as_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def setting(
    name: str,
    default: Any,
    parse: Callable[[str, str], Any],
    doc: str,
    shown: str | None = None,
    secret: bool = False,
) -> Any:
    """A `Settings` field read from environment variable `name` (see `VARIABLES`). A
    `secret` one is left out of the settings' repr, so no log or error message holds it."""
    return dataclass_field(default=default, repr=not secret, metadata={"variable": (name, parse, doc, shown)})


@dataclass(frozen=True)
class Settings:
    """Every setting of the system, one field per environment variable."""

    home: Path = setting(
        "VCHAN_HOME", Path(".vchan"), _text, "directory of the embedded stack (etcd data, local storage)"
    )
    root: str = setting("VCHAN_ROOT", "vchan", _root, "root prefix of every etcd key")
    etcd_endpoints: tuple[str, ...] | None = setting(
        "VCHAN_ETCD_ENDPOINTS",
        None,
        _endpoints,
        "`host:port,host2:port` of an etcd v3 cluster",
        "unset: embedded etcd",
    )
    etcd_user: str | None = setting(
        "VCHAN_ETCD_USER", None, _text, "etcd user (set together with `VCHAN_ETCD_PASSWORD`)"
    )
    etcd_password: str | None = setting("VCHAN_ETCD_PASSWORD", None, _text, "etcd password", secret=True)
    etcd_ca_cert: str | None = setting(
        "VCHAN_ETCD_CA_CERT", None, _existing_file, "CA certificate file: enables TLS to etcd"
    )
    etcd_cert: str | None = setting(
        "VCHAN_ETCD_CERT",
        None,
        _existing_file,
        "client certificate file for etcd TLS (with `VCHAN_ETCD_KEY`)",
    )
    etcd_key: str | None = setting("VCHAN_ETCD_KEY", None, _existing_file, "client key file for etcd TLS")
    etcd_timeout: float = setting(
        "VCHAN_ETCD_TIMEOUT",
        5.0,
        _positive_float,
        "seconds before an etcd call fails with `MetaUnavailableError`",
    )
    storage_uri: str = setting(
        "VCHAN_STORAGE_URI",
        ".vchan/storage",
        _storage_uri,
        "object storage root: a local path or `s3://bucket/prefix`",
        "`$VCHAN_HOME/storage`",
    )
    s3_endpoint: str | None = setting(
        "VCHAN_S3_ENDPOINT",
        None,
        _text,
        "endpoint of an S3-compatible server (`http://host:port`); credentials from the usual `AWS_*` variables",
    )
    s3_region: str = setting("VCHAN_S3_REGION", "us-east-1", _text, "S3 region")
    spark_master: str = setting(
        "VCHAN_SPARK_MASTER", "local[*]", _text, "Spark master URL (standalone, YARN, k8s)"
    )
    spark_remote: str | None = setting(
        "VCHAN_SPARK_REMOTE", None, _spark_remote, "Spark Connect URL `sc://host:port` (wins over the master)"
    )
    session_ttl: float = setting(
        "VCHAN_SESSION_TTL",
        10.0,
        _positive_float,
        "seconds a node session lives without keep-alive (production: 30)",
    )
    append_lock_ttl: float = setting(
        "VCHAN_APPEND_LOCK_TTL",
        10.0,
        _positive_float,
        "seconds a channel's append lock outlives a killed producer (etcd lease TTL)",
    )
    client_retry_timeout: float = setting(
        "VCHAN_CLIENT_RETRY_TIMEOUT",
        30.0,
        _positive_float,
        "seconds a producer call retries while etcd or storage is unavailable",
    )
    watch_timeout: float = setting(
        "VCHAN_WATCH_TIMEOUT",
        300.0,
        _positive_float,
        "seconds before a stuck ToWatch/ToRelease is reassigned",
    )
    tickler_interval: float = setting(
        "VCHAN_TICKLER_INTERVAL", 15.0, _positive_float, "seconds between watch progress updates"
    )
    segment_max_size_mb: float = setting(
        "VCHAN_SEGMENT_MAX_SIZE_MB", 1024.0, _positive_float, "segment size at which it is sealed"
    )
    segment_seal_proportion: float = setting(
        "VCHAN_SEGMENT_SEAL_PROPORTION",
        0.12,
        _proportion,
        "share of the max size at which a growing segment may be sealed",
    )
    segment_max_life: float = setting(
        "VCHAN_SEGMENT_MAX_LIFE", 86400.0, _positive_float, "seconds after which a growing segment is sealed"
    )
    segment_max_idle: float = setting(
        "VCHAN_SEGMENT_MAX_IDLE",
        600.0,
        _positive_float,
        "seconds without inserts after which a segment is sealed",
    )
    segment_max_binlog_files: int = setting(
        "VCHAN_SEGMENT_MAX_BINLOG_FILES",
        32,
        _positive_int,
        "binlog files per column group at which a growing segment is sealed (bounds its etcd value)",
    )
    sync_buffer_mb: float = setting(
        "VCHAN_SYNC_BUFFER_MB", 16.0, _positive_float, "buffered log data that triggers a sync"
    )
    sync_max_age: float = setting(
        "VCHAN_SYNC_MAX_AGE",
        600.0,
        _positive_float,
        "age in seconds of the oldest unsynced row that triggers a sync",
    )
    timetick_lag_warn: float = setting(
        "VCHAN_TIMETICK_LAG_WARN", 120.0, _positive_float, "seconds of time-tick lag before a warning"
    )
    gc_interval: float = setting(
        "VCHAN_GC_INTERVAL", 3600.0, _positive_float, "seconds between garbage collections"
    )
    gc_missing_tolerance: float = setting(
        "VCHAN_GC_MISSING_TOLERANCE", 86400.0, _positive_float, "seconds before an orphan file is removed"
    )
    gc_drop_tolerance: float = setting(
        "VCHAN_GC_DROP_TOLERANCE",
        10800.0,
        _positive_float,
        "seconds before a dropped segment's files are removed",
    )
    wal_retention: float = setting(
        "VCHAN_WAL_RETENTION",
        86400.0,
        _positive_float,
        "seconds a log file wholly below its channel checkpoint is kept before GC removes it",
    )
    lifecycle_interval: float = setting(
        "VCHAN_LIFECYCLE_INTERVAL",
        300.0,
        _positive_float,
        "seconds between the active DataCoord's lifecycle steps (plans, sort, compaction, GC)",
    )
    sort_poll_interval: float = setting(
        "VCHAN_SORT_POLL_INTERVAL",
        2.0,
        _positive_float,
        "seconds between the active DataCoord's looks for newly flushed segments to sort by pk",
    )
    compaction_small_proportion: float = setting(
        "VCHAN_COMPACTION_SMALL_PROPORTION",
        0.5,
        _proportion,
        "a Flushed segment below this fraction of the max size is merged by mix compaction",
    )
    compaction_tier_factor: float = setting(
        "VCHAN_COMPACTION_TIER_FACTOR",
        2.0,
        _factor,
        "mix compaction merges small segments of one size tier: at most this many times the tier's smallest",
    )
    compaction_delete_ratio: float = setting(
        "VCHAN_COMPACTION_DELETE_RATIO",
        0.2,
        _proportion,
        "a Flushed segment with more deleted rows than this fraction is rewritten by mix compaction",
    )
    compaction_timeout: float = setting(
        "VCHAN_COMPACTION_TIMEOUT", 900.0, _positive_float, "seconds before an executing plan is failed"
    )
    compaction_plan_retention: float = setting(
        "VCHAN_COMPACTION_PLAN_RETENTION",
        86400.0,
        _positive_float,
        "seconds a finished compaction plan stays in etcd (for status) before cleanup deletes it",
    )
    import_interval: float = setting(
        "VCHAN_IMPORT_INTERVAL",
        2.0,
        _positive_float,
        "seconds between the active DataCoord's import steps (start Pending jobs, take over stuck ones)",
    )
    import_buffer_mb: float = setting(
        "VCHAN_IMPORT_BUFFER_MB",
        128.0,
        _positive_float,
        "rows an import task buffers before writing binlogs (memory per task, flat in the rows imported)",
    )
    import_timeout: float = setting(
        "VCHAN_IMPORT_TIMEOUT",
        900.0,
        _positive_float,
        "seconds without progress after which the DataCoord takes over (resumes or retries) an import job",
    )
    import_max_attempts: int = setting(
        "VCHAN_IMPORT_MAX_ATTEMPTS",
        3,
        _positive_int,
        "attempts of an import job's pre-import and import before it fails",
    )
    spark_partitions: int = setting(
        "VCHAN_SPARK_PARTITIONS",
        2,
        _positive_int,
        'Spark tasks per sync job; a `format("vchan")` read plans at least twice as many',
    )
    sync_in_process_mb: float = setting(
        "VCHAN_SYNC_IN_PROCESS_MB",
        32.0,
        _non_negative_float,
        "log MB up to which a sync writes its binlogs in the DataNode's process (one thread per task), not as a Spark job: a Spark job's fixed cost is most of a small sync's time (0: always Spark)",
    )
    dagster_datanodes: int = setting(
        "VCHAN_DAGSTER_DATANODES",
        2,
        _positive_int,
        "DataNodes hosted by Dagster sensors (`datanode_1` .. `datanode_N`)",
    )

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
            values[var.field] = var.default if raw is None or raw == "" else var.parse(var.name, raw)
        _check_pair(env, "VCHAN_ETCD_USER", "VCHAN_ETCD_PASSWORD", "user and password")
        _check_pair(env, "VCHAN_ETCD_CERT", "VCHAN_ETCD_KEY", "certificate and key")
        home = Path(values["home"]).absolute()
        storage = values["storage_uri"] if env.get("VCHAN_STORAGE_URI") else str(home / "storage")
        if not storage.startswith("s3://"):
            storage = str(Path(storage.removeprefix("file://")).absolute())
        return cls(**{**values, "home": home, "storage_uri": storage})

    def to_env(self) -> dict[str, str]:
        """The VCHAN_* variables that reproduce these settings in a child process."""
        env = {}
        for var in VARIABLES:
            text = var.text(getattr(self, var.field))
            if text is not None:
                env[var.name] = text
        return env


def _check_pair(env: Mapping[str, str], first: str, second: str, what: str) -> None:
    if bool(env.get(first)) != bool(env.get(second)):
        missing = second if env.get(first) else first
        raise ConfigError(missing, "", f"set together with its pair ({what})")


VARIABLES: tuple[Variable, ...] = tuple(
    Variable(meta[0], f.name, f.default, meta[1], meta[2], meta[3])
    for f in dataclass_fields(Settings)
    if (meta := f.metadata.get("variable"))
)


def readme_table() -> str:
    """The README's configuration table, generated from `VARIABLES`."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{v.name}` | {v.default_text} | {v.doc} |" for v in VARIABLES]
    return "\n".join(lines) + "\n"
