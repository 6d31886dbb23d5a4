"""How an import job reads on a terminal: one-line descriptions and a progress display
(rows and rows/s) for `vchan import --wait`."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

from vchan_assets.imports.jobs import ImportJob


def describe(job: ImportJob, verbose: bool = False) -> str:
    line = (
        f"job {job.job_id}: {job.state} {job.progress}% {job.collection}/{job.partition} "
        f"{len(job.files)} {job.format} files, {job.rows} rows counted, {job.imported_rows} imported"
    )
    if job.reason:
        line += f"; reason: {job.reason}"
    if verbose and job.segment_ids:
        line += f"; segments {list(job.segment_ids)}"
    return line


class ProgressPrinter:
    """Called with the job at each step: a rich progress bar on a terminal, else one line
    per change of state or progress."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.last: tuple[str, int] | None = None
        self.bar: Any = None  # a rich Progress on a terminal
        self.task: Any = None

    def __enter__(self) -> ProgressPrinter:
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed:,.0f}/{task.total:,.0f} rows"),
                TextColumn("{task.fields[rate]:,.0f} rows/s"),
                TimeElapsedColumn(),
            )
            self.bar.start()
            self.task = self.bar.add_task("import", total=1, rate=0.0)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, job: ImportJob) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rows = job.rows * job.progress // 100
        rate = rows / elapsed
        if self.bar is not None and self.task is not None:
            self.bar.update(
                self.task, description=str(job.state), total=max(job.rows, 1), completed=rows, rate=rate
            )
            return
        if self.last != (job.state, job.progress):
            self.last = (job.state, job.progress)
            print(f"  {job.state:<12} {job.progress:3d}%  {rows:,} rows  {rate:,.0f} rows/s", flush=True)
