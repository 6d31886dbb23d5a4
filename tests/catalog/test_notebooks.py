"""The analyst notebooks run top to bottom on the embedded stack (each in its own
temporary VCHAN_HOME) without errors, in a kernel of this interpreter, and are stored
without outputs."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ["01_quickstart", "02_channel_health", "03_segments_and_binlogs"]
TIMEOUT = {"01_quickstart": 120, "02_channel_health": 180, "03_segments_and_binlogs": 120}


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A kernelspec running this interpreter (the venv's), installed in a temporary
    directory: works from a fresh clone, whatever kernels the machine has."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("kernels")
    install(kernel_name="vchan-test", prefix=str(prefix))
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(prefix / "share" / "jupyter"), *filter(None, [saved])])
    spec = KernelSpecManager().get_kernel_spec("vchan-test")
    assert spec.argv[0] == sys.executable
    yield "vchan-test"
    if saved is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = saved


def _processes_under(directory: Path) -> list[int]:
    """Processes whose VCHAN_HOME is inside `directory`: what a notebook started there."""
    marker = f"VCHAN_HOME={directory}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(marker) for item in environ.split(b"\0")):
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_without_outputs(name: str) -> None:
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs not stripped"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name: str, kernel_name: str, tmp_path: Path) -> None:
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        book,
        kernel_name=kernel_name,
        timeout=TIMEOUT[name],
        resources={"metadata": {"path": str(tmp_path)}},
    )
    # The notebook's temporary VCHAN_HOME goes under tmp_path (the kernel inherits TMPDIR),
    # so whatever it started can be found and stopped if it fails half-way.
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path)
    try:
        client.execute()
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        deadline = time.monotonic() + 15  # the kernel's children exit with it, give them a moment
        while (leftovers := _processes_under(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"{name} left processes running: {leftovers}"
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
