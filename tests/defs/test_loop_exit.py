"""A sync loop's run worker exits once its node has left, whatever its threads still wait on."""

from __future__ import annotations

import subprocess
import sys

# A loop whose report and sync threads are each stuck in a call that never returns (as an
# etcd or Spark Connect call to a server that stopped answering), then left: the threads'
# queued calls are cancelled and the main thread ends.
STUCK = """
import threading
from vchan_assets.defs.sync.loop import NodeSyncLoop
loop = NodeSyncLoop(None, None, 1)
for worker in (loop.reports, loop.syncer):
    worker.submit(threading.Event().wait)
    queued = worker.submit(print, "never")
    worker.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
print("main thread done", flush=True)
"""


def test_a_loop_whose_threads_are_stuck_in_calls_still_lets_its_process_exit() -> None:
    """Python joins a ThreadPoolExecutor's threads at exit: with the loop's threads in one,
    this process never ended (a run worker 60 s past its SIGTERM, the node long gone)."""
    try:
        done = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the process did not exit: {exc.stdout!r}") from None
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["main thread done"]
