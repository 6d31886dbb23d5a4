"""The import graph of src/vchan_assets: imports point down the layers declared in
pyproject.toml ([tool.importlinter], checked by import-linter) and form no cycle.

Each check is also run on a copy of the package with one bad import added, to show it
fails when the graph goes wrong."""

from __future__ import annotations

import graphlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import vchan_assets

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(vchan_assets.__file__).parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def import_cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle among the package's modules (nested imports count), or None."""
    deps = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    try:
        graphlib.TopologicalSorter(deps).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def lint_imports(pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def package_copy(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package on its own import path, with `line` added to `module`."""
    shutil.copytree(PACKAGE, tmp_path / "vchan_assets", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "vchan_assets" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return tmp_path


def test_every_import_points_down_the_layers() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_import_that_climbs_a_layer_breaks_the_contract(tmp_path: Path) -> None:
    # The cycle this contract was made against: the Spark session factory registering
    # the data source of the read side above it.
    copy = package_copy(tmp_path, "spark/session.py", "from vchan_assets.query import reads  # noqa")
    result = lint_imports(copy)
    assert result.returncode != 0
    assert "vchan_assets.spark.session -> vchan_assets.query.reads" in result.stdout


def test_a_module_outside_every_layer_breaks_the_contract(tmp_path: Path) -> None:
    copy = package_copy(tmp_path, "model.py", "")
    (copy / "vchan_assets" / "helpers.py").write_text('"""A room nobody placed."""\n')
    result = lint_imports(copy)
    assert result.returncode != 0
    assert "vchan_assets.helpers" in result.stdout


def test_no_import_cycle() -> None:
    assert import_cycle(grimp.build_graph("vchan_assets")) is None


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("query/view.py", "from vchan_assets.query import reads  # noqa"),
        ("meta/keys.py", "import vchan_assets.meta.store  # noqa"),
    ],
)
def test_an_import_cycle_is_found(tmp_path: Path, module: str, line: str) -> None:
    copy = package_copy(tmp_path, module, line)
    script = (
        "import grimp, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_layers import import_cycle\n"
        "print(import_cycle(grimp.build_graph('vchan_assets')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert module.removesuffix(".py").replace("/", ".") in out.stdout, (
        f"no cycle through {module}: {out.stdout}"
    )
