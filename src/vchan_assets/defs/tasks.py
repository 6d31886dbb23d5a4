"""What a Dagster run that went through the DataCoord's task scheduler (`datacoord.tasks`:
`sorted_segments`, `segment_indexes`) says of its tasks: in its metadata and its log, the
attempts it spent and the segments whose task is Failed or backing off, with the time of
their next try (until then the sensors ask no run for them)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from vchan_assets.datacoord.tasks import RoundReport
from vchan_assets.model import TaskRecord, TaskState


def next_try(t: TaskRecord) -> str:
    """When a held task is tried again: an ISO time, or how it is (`vchan tasks --retry`)."""
    if t.not_before <= 0.0:
        return "only by `vchan tasks --retry`"
    return datetime.fromtimestamp(t.not_before, UTC).isoformat(timespec="seconds")


def held_lines(held: list[TaskRecord]) -> list[str]:
    """One line per held task: its segment, state, attempts, next try and last reason."""
    return [
        f"segment {t.segment_id}: {'Failed' if t.state is TaskState.FAILED else 'backing off'} "
        f"after {t.attempts} attempts, next try {next_try(t)}: {t.reason or 'no reason recorded'}"
        for t in held
    ]


def task_metadata(report: RoundReport, held: list[TaskRecord]) -> dict[str, Any]:
    """The run's tasks as metadata: attempts started, failed attempts (back in the queue
    after their backoff), tasks now Failed or backing off, which and until when."""
    failed = [t for t in held if t.state is TaskState.FAILED]
    return {
        "task_attempts": len(report.ran),
        "task_attempts_failed": len(report.retried) + len(report.failed),
        "tasks_failed": len(failed),
        "tasks_backing_off": len(held) - len(failed),
        "held_segments": "\n".join(held_lines(held)) or "none",
        "next_retry": min((next_try(t) for t in held), default=""),
    }


def log_held(log: logging.Logger | dg.DagsterLogManager, what: str, held: list[TaskRecord]) -> None:
    """A warning naming the held tasks (the sensor asks no run for them before their time)."""
    if held:
        log.warning("%s: %d tasks held back, not run again before their time:\n%s", what, len(held),
                    "\n".join(held_lines(held)))  # fmt: skip
