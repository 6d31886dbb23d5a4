"""`vchan status --json | head`: a reader that goes away ends the command quietly."""

from __future__ import annotations

import os
import subprocess

from vchan_assets.config import Settings

from .helpers import VCHAN, cli_env


def run_into_closed_pipe(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `vchan args` writing into a pipe whose reader has already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [str(VCHAN), *args], env=cli_env(settings), stdout=write_end, stderr=subprocess.PIPE, text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)


def test_status_json_into_a_closed_pipe_exits_quietly(settings: Settings) -> None:
    done = run_into_closed_pipe(settings, "status", "--json", "--no-orphans")

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_metrics_into_a_closed_pipe_exits_quietly(settings: Settings) -> None:
    done = run_into_closed_pipe(settings, "metrics")

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_status_json_watch_piped_to_head_ends_after_the_first_line(settings: Settings) -> None:
    pipeline = (
        f"'{VCHAN}' status --json --watch 0.1 --no-orphans | head -n 1; echo \"exit=${{PIPESTATUS[0]}}\" >&2"
    )
    done = subprocess.run(
        ["bash", "-c", pipeline], env=cli_env(settings), capture_output=True, text=True, timeout=120
    )

    assert done.stdout.startswith("{") and done.stdout.count("\n") == 1
    assert done.stderr.strip() == "exit=0"
