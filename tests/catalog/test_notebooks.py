"""The analyst notebooks run top to bottom without errors, in a kernel of this interpreter,
both ways: on a fresh embedded stack (each in its own temporary VCHAN_HOME) and against a
live `vchan up` deployment; they are stored without outputs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import nbformat
import pytest
import yaml
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

from vchan_assets.defs.history import open_instance
from vchan_assets.defs.partitions import VCHANNELS
from vchan_assets.defs.sync.jobs import CHANNEL_TAG, sync_job
from vchan_assets.deploy.service import INSTANCE_CONFIG, local_storage
from vchan_assets.meta.embedded import EmbeddedEtcd, pid_alive
from vchan_assets.testing.waiting import wait_until

# Each notebook runs in a Jupyter kernel (a child process) on an embedded stack or a `vchan up` one.
pytestmark = pytest.mark.integration

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = [
    "01_quickstart",
    "02_channel_health",
    "03_segments_and_binlogs",
    "04_operate",
    "05_indexes",
    "06_change_stream",
]
TIMEOUT = {
    "01_quickstart": 120,
    "02_channel_health": 180,
    "03_segments_and_binlogs": 120,
    "04_operate": 180,
    "05_indexes": 120,
    "06_change_stream": 240,
}
# Against a live `vchan up` stack: the notebooks whose live mode uses the deployment itself (its
# DataCoord grants the leases and its DataNodes persist the quickstart's rows; the operator's
# view reads the nodes, channels and Dagster runs of the stack). The others do in live mode what
# their fresh run above checks, on a collection of their own.
LIVE_NAMES = ["01_quickstart", "04_operate"]
LIVE_TIMEOUT = 420  # a cell waits for the deployment's Dagster runs to persist the collection
# Parameters the tests inject (papermill's convention, `_set_parameter`): the change stream's
# producer writes for 4 s instead of 12 (the same cells, a third of the rows to stream and count).
TEST_PARAMETERS = {"06_change_stream": "SECONDS = 4"}


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


def _run(
    book: nbformat.NotebookNode, name: str, kernel_name: str, tmp_path: Path, timeout: int | None = None
) -> None:
    client = NotebookClient(
        book,
        kernel_name=kernel_name,
        timeout=timeout or TIMEOUT[name],
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


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name: str, kernel_name: str, tmp_path: Path) -> None:
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    if name in TEST_PARAMETERS:
        _set_parameter(book, TEST_PARAMETERS[name])
    _run(book, name, kernel_name, tmp_path)


def _set_parameter(book: nbformat.NotebookNode, line: str) -> None:
    """Papermill's convention: the cell tagged `parameters` holds the defaults; an injected
    assignment after it overrides them."""
    index = next(i for i, c in enumerate(book.cells) if "parameters" in c.metadata.get("tags", []))
    book.cells.insert(index + 1, nbformat.v4.new_code_cell(line, metadata={"tags": ["injected-parameters"]}))


def _texts(book: nbformat.NotebookNode) -> str:
    parts = []
    for cell in book.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


def _vchan(home: Path, *args: str, timeout: float = 240) -> str:
    """`vchan ARGS` on the stack of `home` (syncs as soon as a row is 1 s old); its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(VCHAN_HOME=str(home), VCHAN_SYNC_MAX_AGE="1")
    vchan = str(Path(sys.executable).parent / "vchan")
    done = subprocess.run([vchan, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"vchan {' '.join(args)}: {done.stdout[-1500:]}{done.stderr[-1500:]}"
    return done.stdout


@pytest.fixture(scope="module")
def live_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`vchan up` in a fresh VCHAN_HOME (etcd, Spark Connect, the Dagster daemon and webserver:
    the deployment syncs on its own), a collection produced and flushed with `vchan produce`;
    `vchan down` after the module."""
    home = tmp_path_factory.mktemp("live") / "home"
    try:
        up = _vchan(home, "up")
        # `vchan up` returns with its stack running: etcd outlives it (`vchan down` stops it:
        # the last test of this module).
        assert "etcd_version" in up and "3.5" in up, up
        etcd = EmbeddedEtcd(home / "etcd")._read_state()
        assert etcd is not None and pid_alive(etcd["pid"]), "etcd did not outlive `vchan up`"
        _vchan(home, "create-collection", "--collection", "live_ops", "--dim", "8", "--shards", "2")
        _vchan(home, "produce", "--collection", "live_ops", "--rows", "2000", "--deletes", "100", "--flush")
        yield home
    finally:
        _vchan(home, "down")  # (again, if the last test stopped it: `vchan down` of nothing is a no-op)


@pytest.mark.parametrize("name", LIVE_NAMES)
def test_notebook_runs_against_a_live_vchan_up_stack(
    name: str, live_home: Path, kernel_name: str, tmp_path: Path
) -> None:
    """MODE = "live": the notebook works on the `vchan up` deployment of VCHAN_HOME (its own
    collection, persisted by that deployment's DataNodes), and its outputs name that stack."""
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    _set_parameter(book, 'MODE = "live"\n' + TEST_PARAMETERS.get(name, ""))
    saved = os.environ.get("VCHAN_HOME")
    os.environ["VCHAN_HOME"] = str(live_home)
    try:
        _run(book, name, kernel_name, tmp_path, timeout=LIVE_TIMEOUT)
    finally:
        if saved is None:
            os.environ.pop("VCHAN_HOME", None)
        else:
            os.environ["VCHAN_HOME"] = saved
    text = _texts(book)
    if name == "04_operate":
        assert "live: etcd 127.0.0.1:" in text and "live_ops" in text
    else:  # the notebook's own collection, with a per-run name, in the live deployment
        assert re.search(r"books_\d{8}_\d{6}", text), f"{name}: its collection is not in the outputs"


def test_vchan_up_keeps_its_dagster_history_under_vchan_home(live_home: Path) -> None:
    """The Dagster instance of a `vchan up` deployment (runs, sensor cursors,
    materializations) lives beside its etcd and storage: a new VCHAN_HOME starts both
    afresh. In the repository's dagster_home/, a fresh cluster's vchannels (same names: ids
    restart) met the earlier cluster's history and its checkpoint check failed."""
    home = live_home / "dagster" / "instance"
    config = (home / "dagster.yaml").read_text()
    assert config.startswith(INSTANCE_CONFIG.read_text())
    assert yaml.safe_load(config)["storage"] == local_storage(home)  # its SQLite files are there
    with open_instance(home) as instance:
        syncs = dg.RunsFilter(job_name=sync_job.name)
        wait_until(lambda: instance.get_runs(syncs), 120, f"a sync run in the instance at {home}", interval=1)
        runs = instance.get_runs(syncs)
        assert {r.tags[CHANNEL_TAG] for r in runs} <= set(instance.get_dynamic_partitions(VCHANNELS))


def test_vchan_down_stops_what_vchan_up_left_running(live_home: Path) -> None:
    """Last in this module: `vchan down` stops the stack of VCHAN_HOME, etcd included."""
    etcd = EmbeddedEtcd(live_home / "etcd")._read_state()
    assert etcd is not None and pid_alive(etcd["pid"])
    down = _vchan(live_home, "down")
    assert "embedded etcd stopped" in down, down
    wait_until(lambda: not pid_alive(etcd["pid"]), 10, "etcd gone after `vchan down`")
