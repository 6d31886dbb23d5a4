"""Settings of the whole system, read once from the environment and passed down.

Every variable is declared once, in the package's table `settings.toml`: its type (one
of the parsers below, registered with `@parser`), default and meaning. `VARIABLES` is
that table, read at import; a mistake in it raises `SettingsTableError` naming the entry.
`Settings` has one typed field per row, its default taken from the row; `from_env`
parses the environment, `to_env` writes it back for child processes, the Dagster
resource takes one field per row, and the README's configuration table is generated
from it (`readme_table`). A wrong value raises `ConfigError` naming the variable and
what was expected, before anything starts.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from vchan_assets.errors import DeclaredError


class ConfigError(DeclaredError, ValueError):
    """A setting has a value the system cannot use."""

    variable: str
    value: str
    expected: str
    message = "{variable}={value!r} is invalid: expected {expected}"


class SettingsTableError(DeclaredError, ValueError):
    """The settings table (`settings.toml`) declares something the code cannot use."""

    entry: str
    problem: str
    message = "settings.toml [{entry}]: {problem}"


Parser = Callable[[str, str], Any]
PARSERS: dict[str, Parser] = {}  # the table's types, by name


def parser(parse: Parser) -> Parser:
    """Make `parse(variable, text)` a type of the settings table, named like the function."""
    PARSERS[parse.__name__] = parse
    return parse


@parser
def finite_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "a number") from None
    if not math.isfinite(value):
        raise ConfigError(name, raw, "a finite number")
    return value


@parser
def whole_number(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(name, raw, "a whole number") from None


def _bounded(name: str, parse: Parser, within: Callable[[Any], bool], expected: str) -> Parser:
    """The parser `name`: `parse`, then a ConfigError expecting `expected` unless `within`."""

    def bounded(variable: str, raw: str) -> Any:
        value = parse(variable, raw)
        if not within(value):
            raise ConfigError(variable, raw, expected)
        return value

    bounded.__name__ = name
    return parser(bounded)


positive_float = _bounded("positive_float", finite_float, lambda v: v > 0, "a number greater than 0")
non_negative_float = _bounded("non_negative_float", finite_float, lambda v: v >= 0, "a number of at least 0")
positive_int = _bounded("positive_int", whole_number, lambda v: v > 0, "a whole number greater than 0")
proportion = _bounded("proportion", positive_float, lambda v: v <= 1, "a proportion in (0, 1]")
factor = _bounded("factor", positive_float, lambda v: v >= 1, "a factor of at least 1")


@parser
def endpoints(name: str, raw: str) -> tuple[str, ...]:
    endpoints = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not endpoints:
        raise ConfigError(name, raw, "a comma-separated list of host:port")
    for endpoint in endpoints:
        host, sep, port = endpoint.removeprefix("http://").removeprefix("https://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(name, raw, "a comma-separated list of host:port (port 1-65535)")
    return endpoints


@parser
def existing_file(name: str, raw: str) -> str:
    if not Path(raw).is_file():
        raise ConfigError(name, raw, "the path of a readable file")
    return raw


@parser
def storage_uri(name: str, raw: str) -> str:
    if "://" in raw and not raw.startswith(("s3://", "file://")):
        raise ConfigError(name, raw, "a local path, file://path or s3://bucket/prefix")
    if raw.startswith("s3://") and not raw.removeprefix("s3://").strip("/"):
        raise ConfigError(name, raw, "s3://bucket/prefix with a bucket name")
    return raw


@parser
def spark_remote(name: str, raw: str) -> str:
    if not raw.startswith("sc://") or not raw.removeprefix("sc://").strip("/"):
        raise ConfigError(name, raw, "a Spark Connect URL such as sc://localhost:15002")
    return raw


@parser
def postgres_url(name: str, raw: str) -> str:
    if not raw.startswith(("postgresql://", "postgres://")) or "/" not in raw.split("://", 1)[1]:
        raise ConfigError(name, raw, "a PostgreSQL URL such as postgresql://user:password@host:5432/dagster")
    return raw


@parser
def root(name: str, raw: str) -> str:
    root = raw.strip("/")
    if not root or any(c.isspace() for c in root):
        raise ConfigError(name, raw, "a non-empty key prefix without spaces")
    return root


@parser
def switch(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise ConfigError(name, raw, "on or off")


@parser
def text(name: str, raw: str) -> str:
    return raw


@parser
def path(name: str, raw: str) -> Path:
    return Path(raw)


# --- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variable:
    """One environment variable, a row of the table: the `Settings` field it fills, how
    its text is parsed, its default (None: unset) and its meaning."""

    name: str
    field: str
    default: Any
    parse: Parser
    doc: str
    shown_default: str | None = None  # the README's default column, where it is derived
    secret: bool = False

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
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


_KEYS = {"type", "default", "doc", "shown", "secret"}


def read_table(text: str) -> tuple[Variable, ...]:
    """The variables of a settings table, each checked: known keys and type, a doc, a
    default its type accepts."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsTableError("*", f"not valid TOML: {exc}") from None
    return tuple(_variable(name, entry) for name, entry in table.items())


def _variable(name: str, entry: Any) -> Variable:
    if not name.startswith("VCHAN_") or not isinstance(entry, dict):
        raise SettingsTableError(name, "expected a [VCHAN_*] table of keys")
    if unknown := set(entry) - _KEYS:
        raise SettingsTableError(name, f"unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
    if missing := {"type", "doc"} - set(entry):
        raise SettingsTableError(name, f"missing {sorted(missing)}")
    parse = PARSERS.get(entry["type"])
    if parse is None:
        raise SettingsTableError(name, f"unknown type {entry['type']!r}; known: {sorted(PARSERS)}")
    default = entry.get("default")
    if default is not None:
        try:
            default = parse(name, str(default))
        except ConfigError as exc:
            raise SettingsTableError(name, f"its default is invalid: {exc}") from None
    field = name.removeprefix("VCHAN_").lower()
    return Variable(name, field, default, parse, entry["doc"], entry.get("shown"), entry.get("secret", False))


VARIABLES: tuple[Variable, ...] = read_table(
    resources.files("vchan_assets").joinpath("settings.toml").read_text()
)

FROM_TABLE: Any = None  # a field's default placeholder: `_from_table` puts the row's default there
_C = TypeVar("_C", bound=type)


def _from_table(cls: _C) -> _C:
    """Give each field of `cls` its row's default (and hide a secret one from repr); the
    fields must be the table's rows, in its order."""
    names, rows = list(cls.__annotations__), [var.field for var in VARIABLES]
    if names != rows:
        unfilled = [var.name for var in VARIABLES if var.field not in names]
        undeclared = [name for name in names if name not in rows]
        raise SettingsTableError(
            unfilled[0] if unfilled else "*",
            f"rows without a Settings field: {unfilled}; Settings fields without a row: {undeclared}"
            if unfilled or undeclared
            else "Settings declares its fields in another order than the table's rows",
        )
    for var in VARIABLES:
        setattr(cls, var.field, dataclass_field(default=var.default, repr=not var.secret))
    return cls


@dataclass(frozen=True)
@_from_table
class Settings:
    """Every setting of the system, one field per row of `settings.toml`, in its order."""

    home: Path = FROM_TABLE
    root: str = FROM_TABLE
    etcd_endpoints: tuple[str, ...] | None = FROM_TABLE
    etcd_user: str | None = FROM_TABLE
    etcd_password: str | None = FROM_TABLE
    etcd_ca_cert: str | None = FROM_TABLE
    etcd_cert: str | None = FROM_TABLE
    etcd_key: str | None = FROM_TABLE
    etcd_timeout: float = FROM_TABLE
    etcd_connect_timeout: float = FROM_TABLE
    storage_uri: str = FROM_TABLE
    s3_endpoint: str | None = FROM_TABLE
    s3_region: str = FROM_TABLE
    spark_master: str = FROM_TABLE
    spark_remote: str | None = FROM_TABLE
    session_ttl: float = FROM_TABLE
    stop_timeout: float = FROM_TABLE
    health_interval: float = FROM_TABLE
    balance_version: str | None = FROM_TABLE
    append_lock_ttl: float = FROM_TABLE
    client_retry_timeout: float = FROM_TABLE
    write_lag_limit_mb: float = FROM_TABLE
    write_lag_limit_seconds: float = FROM_TABLE
    watch_timeout: float = FROM_TABLE
    auto_balance: bool = FROM_TABLE
    tickler_interval: float = FROM_TABLE
    segment_max_size_mb: float = FROM_TABLE
    segment_seal_proportion: float = FROM_TABLE
    segment_max_life: float = FROM_TABLE
    segment_max_idle: float = FROM_TABLE
    segment_max_binlog_files: int = FROM_TABLE
    sync_buffer_mb: float = FROM_TABLE
    sync_max_age: float = FROM_TABLE
    timetick_lag_warn: float = FROM_TABLE
    gc_enabled: bool = FROM_TABLE
    gc_interval: float = FROM_TABLE
    gc_missing_tolerance: float = FROM_TABLE
    gc_drop_tolerance: float = FROM_TABLE
    wal_retention: float = FROM_TABLE
    lifecycle_interval: float = FROM_TABLE
    time_travel: float = FROM_TABLE
    read_pin_ttl: float = FROM_TABLE
    read_pin_reuse: float = FROM_TABLE
    stream_idle_timeout: float = FROM_TABLE
    sort_scan_interval: float = FROM_TABLE
    sort_leftover_after: float = FROM_TABLE
    compaction_enabled: bool = FROM_TABLE
    compaction_check_interval: float = FROM_TABLE
    l0_compaction_trigger_count: int = FROM_TABLE
    l0_compaction_trigger_mb: float = FROM_TABLE
    invisible_segment_limit: int = FROM_TABLE
    index_handoff_timeout: float = FROM_TABLE
    index_recall_floor: float = FROM_TABLE
    compaction_small_proportion: float = FROM_TABLE
    compaction_tier_factor: float = FROM_TABLE
    compaction_delete_ratio: float = FROM_TABLE
    compaction_timeout: float = FROM_TABLE
    compaction_plan_retention: float = FROM_TABLE
    import_job_retention: float = FROM_TABLE
    task_slots: int = FROM_TABLE
    task_memory_mb: float = FROM_TABLE
    task_max_attempts: int = FROM_TABLE
    task_timeout: float = FROM_TABLE
    task_retry_backoff: float = FROM_TABLE
    task_retry_backoff_max: float = FROM_TABLE
    task_failed_retry: float = FROM_TABLE
    import_interval: float = FROM_TABLE
    import_buffer_mb: float = FROM_TABLE
    import_timeout: float = FROM_TABLE
    import_max_attempts: int = FROM_TABLE
    spark_partitions: int = FROM_TABLE
    sync_in_process_mb: float = FROM_TABLE
    dagster_datanodes: int = FROM_TABLE
    checkpoint_freshness: float = FROM_TABLE
    dagster_postgres_url: str | None = FROM_TABLE
    dagster_sync_loop: float = FROM_TABLE
    dagster_retention_days: float = FROM_TABLE

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


def readme_table() -> str:
    """The README's configuration table, generated from `VARIABLES`."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{v.name}` | {v.default_text} | {v.doc} |" for v in VARIABLES]
    return "\n".join(lines) + "\n"
