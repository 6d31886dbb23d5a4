"""Settings from the environment: the documented defaults, and a clear error per bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from vchan_assets.config import (
    VARIABLES,
    ConfigError,
    Settings,
    SettingsTableError,
    positive_float,
    positive_int,
    proportion,
    read_table,
)

NUMERIC = [v.name for v in VARIABLES if v.parse in (positive_float, positive_int, proportion)]


def _error(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as bad:
        Settings.from_env(env)
    return bad.value


def _assert_names(error: ConfigError, variable: str) -> None:
    assert error.variable == variable
    assert variable in str(error)


def test_defaults_match_the_design() -> None:
    s = Settings.from_env({})

    assert s.root == "vchan" and s.embedded_etcd and s.etcd_timeout == 5
    assert s.session_ttl == 10
    assert s.watch_timeout == 300
    assert s.tickler_interval == 15
    assert s.segment_max_size_mb == 1024
    assert s.segment_seal_proportion == 0.12
    assert s.segment_max_life == 24 * 3600
    assert s.segment_max_idle == 10 * 60
    assert s.sync_buffer_mb == 16
    assert s.sync_max_age == 600
    assert s.timetick_lag_warn == 2 * 60
    assert s.gc_interval == 3600
    assert s.gc_missing_tolerance == 24 * 3600
    assert s.gc_drop_tolerance == 3 * 3600
    assert s.spark_master == "local[*]" and s.spark_remote is None


def test_dataclass_defaults_equal_the_environment_defaults() -> None:
    from_env = Settings.from_env({})
    plain = Settings()

    for name in (
        "root",
        "etcd_timeout",
        "session_ttl",
        "watch_timeout",
        "segment_max_size_mb",
        "spark_partitions",
    ):
        assert getattr(from_env, name) == getattr(plain, name)


def test_default_storage_lives_under_the_home_directory(tmp_path: Path) -> None:
    s = Settings.from_env({"VCHAN_HOME": str(tmp_path / "h")})

    assert s.home == tmp_path / "h" and s.storage_uri == str(tmp_path / "h" / "storage")


def test_values_from_the_environment_are_parsed() -> None:
    s = Settings.from_env(
        {
            "VCHAN_ETCD_ENDPOINTS": "10.0.0.1:2379, etcd-2:2380",
            "VCHAN_SESSION_TTL": "30",
            "VCHAN_STORAGE_URI": "s3://bucket/prefix",
            "VCHAN_SPARK_REMOTE": "sc://spark:15002",
            "VCHAN_SPARK_PARTITIONS": "8",
            "VCHAN_ROOT": "/by-dev/",
        }
    )

    assert s.etcd_endpoints == ("10.0.0.1:2379", "etcd-2:2380") and not s.embedded_etcd
    assert s.session_ttl == 30.0 and s.spark_partitions == 8
    assert s.storage_uri == "s3://bucket/prefix" and s.spark_remote == "sc://spark:15002"
    assert s.root == "by-dev"


def test_empty_value_means_the_default() -> None:
    assert Settings.from_env({"VCHAN_SESSION_TTL": ""}).session_ttl == 10


@pytest.mark.parametrize("variable", NUMERIC)
@pytest.mark.parametrize("raw", ["ten", "0", "-1", "nan", "inf"])
def test_numeric_setting_with_a_bad_value_names_the_variable(variable: str, raw: str) -> None:
    error = _error({variable: raw})

    _assert_names(error, variable)
    assert error.value == raw


def test_whole_number_setting_rejects_a_fraction() -> None:
    _assert_names(_error({"VCHAN_SPARK_PARTITIONS": "1.5"}), "VCHAN_SPARK_PARTITIONS")


@pytest.mark.parametrize("raw", ["-1", "nan", "ten"])
def test_in_process_sync_size_rejects_a_negative_or_non_number(raw: str) -> None:
    _assert_names(_error({"VCHAN_SYNC_IN_PROCESS_MB": raw}), "VCHAN_SYNC_IN_PROCESS_MB")


def test_in_process_sync_size_zero_means_always_spark() -> None:
    assert Settings.from_env({"VCHAN_SYNC_IN_PROCESS_MB": "0"}).sync_in_process_mb == 0


def test_seal_proportion_above_one_is_rejected() -> None:
    error = _error({"VCHAN_SEGMENT_SEAL_PROPORTION": "1.5"})

    _assert_names(error, "VCHAN_SEGMENT_SEAL_PROPORTION")
    assert "proportion" in str(error)


@pytest.mark.parametrize("raw", ["localhost", "host:", ":2379", "host:abc", "host:0", "host:70000", " , "])
def test_bad_etcd_endpoints_are_rejected(raw: str) -> None:
    error = _error({"VCHAN_ETCD_ENDPOINTS": raw})

    _assert_names(error, "VCHAN_ETCD_ENDPOINTS")
    assert "host:port" in str(error)


@pytest.mark.parametrize("raw", ["gs://bucket/x", "http://host/bucket", "s3://", "s3:///"])
def test_bad_storage_uri_is_rejected(raw: str) -> None:
    _assert_names(_error({"VCHAN_STORAGE_URI": raw}), "VCHAN_STORAGE_URI")


@pytest.mark.parametrize("raw", ["http://spark:15002", "spark:15002", "sc://"])
def test_bad_spark_remote_is_rejected(raw: str) -> None:
    error = _error({"VCHAN_SPARK_REMOTE": raw})

    _assert_names(error, "VCHAN_SPARK_REMOTE")
    assert "sc://" in str(error)


@pytest.mark.parametrize("raw", ["/", "a b"])
def test_bad_root_prefix_is_rejected(raw: str) -> None:
    _assert_names(_error({"VCHAN_ROOT": raw}), "VCHAN_ROOT")


def test_etcd_user_without_password_names_the_missing_password() -> None:
    _assert_names(_error({"VCHAN_ETCD_USER": "root"}), "VCHAN_ETCD_PASSWORD")


def test_etcd_password_without_user_names_the_missing_user() -> None:
    _assert_names(_error({"VCHAN_ETCD_PASSWORD": "secret"}), "VCHAN_ETCD_USER")


@pytest.mark.parametrize("variable", ["VCHAN_ETCD_CA_CERT", "VCHAN_ETCD_CERT", "VCHAN_ETCD_KEY"])
def test_missing_tls_file_names_the_variable(variable: str, tmp_path: Path) -> None:
    error = _error({variable: str(tmp_path / "absent.pem")})

    _assert_names(error, variable)
    assert "absent.pem" in str(error)


def test_client_certificate_without_its_key_names_the_key(tmp_path: Path) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")

    _assert_names(_error({"VCHAN_ETCD_CERT": str(cert)}), "VCHAN_ETCD_KEY")


def test_tls_files_that_exist_are_accepted(tmp_path: Path) -> None:
    files = {}
    for variable in ("VCHAN_ETCD_CA_CERT", "VCHAN_ETCD_CERT", "VCHAN_ETCD_KEY"):
        path = tmp_path / f"{variable.lower()}.pem"
        path.write_text("pem")
        files[variable] = str(path)

    s = Settings.from_env(files)

    assert (s.etcd_ca_cert, s.etcd_cert, s.etcd_key) == tuple(files.values())


def test_the_first_bad_value_is_reported_even_with_other_good_ones() -> None:
    error = _error({"VCHAN_SESSION_TTL": "30", "VCHAN_WATCH_TIMEOUT": "soon"})

    _assert_names(error, "VCHAN_WATCH_TIMEOUT")


def test_settings_survive_the_trip_through_a_child_environment(tmp_path: Path) -> None:
    cert = tmp_path / "ca.pem"
    cert.write_text("pem")
    s = Settings.from_env(
        {
            "VCHAN_HOME": str(tmp_path),
            "VCHAN_ETCD_ENDPOINTS": "etcd-1:2379,etcd-2:2379",
            "VCHAN_ETCD_USER": "root",
            "VCHAN_ETCD_PASSWORD": "secret",
            "VCHAN_ETCD_CA_CERT": str(cert),
            "VCHAN_SEGMENT_SEAL_PROPORTION": "0.25",
            "VCHAN_SPARK_PARTITIONS": "8",
        }
    )

    assert Settings.from_env(s.to_env()) == s


def test_every_settings_field_is_a_row_of_the_table() -> None:
    from dataclasses import fields

    assert [v.field for v in VARIABLES] == [f.name for f in fields(Settings)]
    assert all(v.name.startswith("VCHAN_") and v.doc for v in VARIABLES)


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ('type = "positve_float"\ndoc = "d"', "unknown type 'positve_float'; known: ["),
        ('type = "positive_float"\ndefualt = 5\ndoc = "d"', "unknown keys ['defualt']"),
        (
            'type = "positive_float"\ndefault = -1\ndoc = "d"',
            "its default is invalid: VCHAN_X='-1' is invalid",
        ),
        ('type = "positive_int"\ndefault = 2.5\ndoc = "d"', "its default is invalid"),
        ('type = "text"', "missing ['doc']"),
    ],
)
def test_a_mistake_in_the_settings_table_names_the_entry(row: str, problem: str) -> None:
    with pytest.raises(SettingsTableError) as bad:
        read_table(f'[VCHAN_OK]\ntype = "text"\ndoc = "fine"\n\n[VCHAN_X]\n{row}\n')

    assert str(bad.value).startswith("settings.toml [VCHAN_X]: ")
    assert problem in str(bad.value)


def test_a_settings_table_that_is_not_toml_says_so() -> None:
    with pytest.raises(SettingsTableError, match=r"settings.toml \[\*\]: not valid TOML"):
        read_table("[VCHAN_X\n")


def test_the_table_is_package_data() -> None:
    """The table is read from the package (pyproject's package-data ships it in the wheel)."""
    from importlib import resources

    table = resources.files("vchan_assets").joinpath("settings.toml").read_text()
    assert read_table(table) == VARIABLES
