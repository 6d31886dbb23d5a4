"""The Dagster resource of the system: its fields are the settings table, nothing more."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from vchan_assets.config import VARIABLES, ConfigError, Settings
from vchan_assets.defs.resources import VchanEnvResource, VchanResource


def test_the_resource_has_one_field_per_setting() -> None:
    """The fields are declared by hand: a row added to settings.toml (or renamed, moved,
    or its meaning changed) without its field here fails."""
    assert list(VchanResource.model_fields) == [v.field for v in VARIABLES]
    for var in VARIABLES:
        field = VchanResource.model_fields[var.field]
        assert field.annotation == str | None, var.name
        assert field.default is None, var.name  # unset: the table's default, via Settings
        assert field.description == f"{var.name}: {var.doc} [default: {var.default_text}]", var.name


def test_the_dagster_config_schema_shows_each_setting_with_its_description() -> None:
    fields = VchanResource.to_config_schema().as_field().config_type.fields  # type: ignore[attr-defined]
    assert list(fields) == [v.field for v in VARIABLES]
    assert fields["session_ttl"].description.startswith("VCHAN_SESSION_TTL: seconds a node session lives")
    assert not fields["session_ttl"].is_required


def test_a_resource_built_from_settings_gives_the_same_settings(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"VCHAN_HOME": str(tmp_path), "VCHAN_ETCD_ENDPOINTS": "etcd:2379", "VCHAN_SYNC_MAX_AGE": "1.5"}
    )

    assert VchanResource.from_settings(settings).settings() == settings


def test_a_bad_resource_field_names_its_variable() -> None:
    with pytest.raises(ConfigError) as bad:
        VchanResource(session_ttl="soon").settings()

    assert bad.value.variable == "VCHAN_SESSION_TTL"


def test_the_sensors_resource_reads_the_settings_of_the_environment_or_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`vchan_env` (the sensors') has the settings `vchan` (the runs') has in the same code
    server: the process environment's; given settings, only those."""
    monkeypatch.setenv("VCHAN_SESSION_TTL", "33")
    monkeypatch.setenv("VCHAN_ROOT", "envroot")
    with dg.build_resources({"vchan": VchanResource.from_env()}) as built:  # as Dagster resolves it
        assert VchanEnvResource().settings() == built.vchan.settings()
    assert VchanEnvResource().settings().session_ttl == 33.0

    mine = Settings.from_env({"VCHAN_ROOT": "mine", "VCHAN_HOME": "/tmp/mine"})
    given = VchanEnvResource.from_settings(mine).settings()
    assert given == mine and given.session_ttl == Settings.from_env({}).session_ttl

    monkeypatch.setenv("VCHAN_SESSION_TTL", "soon")
    with pytest.raises(ConfigError, match="VCHAN_SESSION_TTL"):
        VchanEnvResource().settings()


def test_the_sensors_resource_has_one_field_so_dagster_builds_it_at_every_tick_cheaply() -> None:
    """Dagster builds a sensor's resources at every evaluation, and the cost of a
    ConfigurableResource grows with its fields (bench.sensor_ticks: 110 ms of CPU a tick for
    the resource and the opening of the system with `vchan`, 35 ms with `vchan_env`)."""
    assert list(VchanEnvResource.model_fields) == ["variables"]
