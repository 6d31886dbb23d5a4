"""`vchan demo` (what `make demo` runs) ends by saying what it leaves running, as found
after it stopped what it stops: with --keep, what still runs, each named for what it is,
and that `vchan down` stops it (it used to end with the address of a Dagster UI it had just
stopped). Without --keep the same `ending` says what stopped: tests/test_demo_ending.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.meta.embedded import pid_alive
from vchan_assets.testing.harness import VCHAN, cli_env

KINDS = ["the Dagster daemon", "the Dagster webserver", "the Spark Connect server", "etcd"]


def _env(settings: Settings, home: Path) -> dict[str, str]:
    """The command's environment, on a stack of its own under `home`."""
    env = {k: v for k, v in cli_env(settings).items() if not k.startswith(("VCHAN_", "AWS_"))}
    env.update(VCHAN_HOME=str(home), VCHAN_SPARK_DRIVER_MEMORY="512m", COLUMNS="160")
    return env


def _demo(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(VCHAN), "demo", "--rows", "2000", "--deletes", "20", "--channels", "2", *args],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def _listed(out: str, heading: str) -> dict[str, int]:
    """The processes listed under `heading` ("stopped:", "still running:"): name -> pid."""
    found = {}
    for line in out.split(f"\n{heading}\n", 1)[1].splitlines():
        listed = re.fullmatch(r"  (.+) \(pid (\d+)\)", line.rstrip())
        if listed is None:
            break
        found[listed[1]] = int(listed[2])
    return found


def _kinds(names: dict[str, int]) -> list[str]:
    return [next(kind for kind in KINDS if name.startswith(kind)) for name in names]


def _command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_the_dagster_demo_with_keep_names_what_still_runs_and_vchan_down_stops_it(
    settings: Settings, tmp_path: Path
) -> None:
    env = _env(settings, tmp_path / "home")
    out = _demo(env, "--keep")
    try:
        assert out.rstrip().splitlines()[-1] == "stop them with `vchan down`", out[-3000:]
        running = _listed(out, "still running:")
        assert _kinds(running) == KINDS, out[-3000:]
        ending = out[out.index("demo finished") :]
        assert "stopped:" not in ending
        assert ending.splitlines()[0].endswith("every delete in a delta log"), ending  # no UI address
        # Each is alive and is what its line says it is.
        programs = ["dagster-daemon", "dagster-webserver", "SparkConnectServer", "etcd"]
        for (name, pid), program in zip(running.items(), programs, strict=True):
            assert pid_alive(pid) and program in _command_line(pid), (name, pid, _command_line(pid))
        (webserver,) = [name for name in running if name.startswith("the Dagster webserver")]
        url = re.search(r"UI (http://127\.0\.0\.1:\d+)", webserver)
        assert url is not None and url[1] in out[: out.index("demo finished")], webserver
    finally:
        down = subprocess.run([str(VCHAN), "down"], env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr[-2000:]
    assert not [pid for pid in running.values() if pid_alive(pid)]
