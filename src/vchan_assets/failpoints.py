"""Named failpoints, the way etcd's gofail works: a test sets VCHAN_FAILPOINT to
`name` (or `name=kill`) and the process SIGKILLs itself exactly at that step, or to
`name=stop` and the process SIGSTOPs itself there (after writing the failpoint's name and
the pid to `$VCHAN_FAILPOINT_MARKER` if set) until the test sends SIGCONT. `kill-once` and
`stop-once` fire in the first process that gets there only (the one that creates the
marker, which they require): for Spark tasks, where every executor's Python workers
have the same environment and a retried task must run through.

Names used by the sync task, in commit order:
  after_binlogs        binlog files written, no meta yet
  after_segment_meta   the first segment-meta transaction committed, maybe not all
  before_checkpoint    all segment meta committed, channel checkpoint not yet
and inside each sync task (a Spark Python worker, or the local engine's process):
  task_written         the task wrote its files, their paths not yet returned

by bulk import (imports/executor.py): import_after_preimport, import_after_binlogs,
import_mid_register (a job registered over several transactions: the first committed, not
all), import_before_commit, import_mid_commit (a job committed over several transactions:
the first committed, not all), import_mid_fail (a failed job dropping its segments over
several transactions: the first committed, with the reason); by the lifecycle: handoff_taken (the DataCoord got a flush's push, no
sort planned yet), compaction_after_files, compaction_after_commit, compaction_before_cleanup,
gc_after_files; by index builds: index_built (indexes/build.py, in the process that builds:
a Spark Python worker, or the local engine's; the index file written, the outcome not
returned) and index_after_files (indexes/step.py, in the committing process: the build's
file written, the build not yet Finished); by reads: read_meta (query/asof.py: a read's timestamp
taken, its channel checkpoints and segment meta not read yet), read_planned (query/reads.py: pinned,
segments chosen, no file opened yet), read_tail_listed (query/asof.py: a log tail's files
listed, none opened yet), stream_read (a change stream's task handed one log file's
changes to Spark, more to come); by the per-vchannel segment index (meta/segments.py):
channel_index_backfill (a transaction of missing entries committed, maybe not all, the mark
not written), move_dropped (a transaction of the Dropped records an older version left in
the live family moved to the dropped family, maybe not all); by paged reads
(meta/store.py): meta_mid_walk (a page of a prefix read, more to come: a DataCoord's first
load of its segment cache, for one).

Names used by the producer's append (wal.appender); the first before the append lock,
the others holding it:
  after_wal_data       an insert batch's data file written, no lock taken
  before_wal_publish   batch built, its log file not written
  after_wal_publish    log file written, channel head not committed
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

ENV = "VCHAN_FAILPOINT"
MARKER_ENV = "VCHAN_FAILPOINT_MARKER"


def failpoint(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, action = spec.partition("=")
    if point != name:
        return
    marker = os.environ.get(MARKER_ENV)
    if action.endswith("-once"):
        action = action.removesuffix("-once")
        if not marker or not mark(marker, name, first=True):
            return
    elif marker:
        mark(marker, name)
    if action in ("", "kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"{ENV}={spec!r}: action must be kill, stop, kill-once or stop-once")


def mark(marker: str, name: str, first: bool = False) -> bool:
    """Write `name pid` to the marker, whole: it appears with its content, never empty or
    half written, so a test that sees the file can read the pid at once. The content is
    written to a file of its own, then renamed into place or, `first`, hard-linked: the link
    fails if the marker exists, so only the first process marks it (False for the others).
    The same steps as `Storage.write_atomic` on local files, which this module, below
    storage in the layers, cannot import."""
    path = Path(marker)
    staged = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    staged.write_text(f"{name} {os.getpid()}")
    try:
        if first:
            os.link(staged, path)
        else:
            staged.replace(path)
    except FileExistsError:
        return False
    finally:
        staged.unlink(missing_ok=True)
    return True
