"""The Dagster resource of the system: its fields are the settings table, nothing more."""

from __future__ import annotations

from pathlib import Path

import pytest

from vchan_assets.config import VARIABLES, ConfigError, Settings
from vchan_assets.defs.resources import VchanResource


def test_the_resource_has_one_field_per_setting() -> None:
    assert list(VchanResource.model_fields) == [v.field for v in VARIABLES]


def test_a_resource_built_from_settings_gives_the_same_settings(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"VCHAN_HOME": str(tmp_path), "VCHAN_ETCD_ENDPOINTS": "etcd:2379", "VCHAN_SYNC_MAX_AGE": "1.5"}
    )

    assert VchanResource.from_settings(settings).settings() == settings


def test_a_bad_resource_field_names_its_variable() -> None:
    with pytest.raises(ConfigError) as bad:
        VchanResource(session_ttl="soon").settings()

    assert bad.value.variable == "VCHAN_SESSION_TTL"
