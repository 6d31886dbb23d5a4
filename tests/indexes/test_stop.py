"""A `vchan datacoord` sent SIGTERM while it builds an index in this process (HNSW, the
slowest build there is) exits within VCHAN_STOP_TIMEOUT: it says STOPPING, puts its
batch in flight back in the queue and resigns; the build it abandoned is finished by the
next DataCoord, under a new version (its own commit would be refused by its ended term)."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid

import numpy as np
import pyarrow as pa

from vchan_assets.datacoord.tasks import list_tasks
from vchan_assets.indexes.meta import create_index
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.model import CollectionSchema, SegmentIndexState, TaskState
from vchan_assets.system import System
from vchan_assets.testing.index_data import Data, builds, datacoord, wait_for
from vchan_assets.testing.steps import sync_all
from vchan_assets.wal.producer import Producer

WIDE = 128
ROWS = 20_000  # in two segments: their HNSW builds take 5-30 s in process on a 2-core machine
STOP_TIMEOUT = 3.0
MARGIN = 7.0  # the etcd writes of the stop and the interpreter's exit, on a loaded machine


def wide_segment(system: System, producer: Producer) -> Data:
    """Two sorted segments (one per vchannel) of `ROWS` random 128-d vectors in all: one
    batch of two builds, run side by side on a thread each."""
    schema = CollectionSchema.build("pk", {"vec": WIDE}, {})
    info = producer.create_collection(f"w{uuid.uuid4().hex[:8]}", schema, num_channels=2)
    vectors = np.random.default_rng(7).normal(size=(ROWS, WIDE)).astype(np.float32)
    rows = pa.table(
        {
            "pk": pa.array(np.arange(1, ROWS + 1, dtype=np.int64)),
            "vec": pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(WIDE * 4), ROWS, [None, pa.py_buffer(vectors)]
            ),
        }
    )
    producer.insert(info.name, rows)
    producer.flush(info.name)
    sync_all(system, info)
    sort_step(system, engine="local")
    return Data(info)


def test_a_datacoord_sent_sigterm_mid_build_exits_in_time_and_the_next_one_finishes_the_build(
    system: System, producer: Producer
) -> None:
    data = wide_segment(system, producer)
    create_index(system.store, data.info, "vec", "HNSW", "L2", {"M": 16, "efConstruction": 200})
    env = {"VCHAN_STOP_TIMEOUT": str(STOP_TIMEOUT)}
    with datacoord(system, **env) as first:
        wait_for(
            first,
            lambda: any(b.state is SegmentIndexState.IN_PROGRESS for b in builds(system, data)),
            "the build started",
        )
        time.sleep(0.3)  # past reading the vectors, into faiss's add
        first.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            first.wait(STOP_TIMEOUT + MARGIN)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {time.monotonic() - sent:.0f}s after SIGTERM "
                f"(VCHAN_STOP_TIMEOUT {STOP_TIMEOUT:g})"
            ) from None
        print(f"vchan datacoord exited {time.monotonic() - sent:.1f}s after SIGTERM")  # (-s shows it)
        assert first.returncode == 0, first.communicate()[0].decode()[-3000:]
        output = first.communicate()[0].decode()
    assert "abandoned" in output, output[-3000:]
    # A build may have finished before the signal (a quiet machine builds fast): the others
    # were abandoned, and committed nothing.
    abandoned = [b.build_id for b in builds(system, data) if b.state is not SegmentIndexState.FINISHED]
    assert abandoned, "no build was in flight at SIGTERM"
    assert not any(b.files for b in builds(system, data) if b.build_id in abandoned)
    tasks = [d.model for d in list_tasks(system.store, "index")]
    assert [t.state for t in tasks] == [TaskState.QUEUED] * len(abandoned), "back in the queue"
    assert all(t.attempts == 0 for t in tasks), "a graceful stop spends no attempt"

    with datacoord(system) as second:
        wait_for(
            second,
            lambda: (
                [b.state for b in builds(system, data)] == [SegmentIndexState.FINISHED] * 2
                and not list_tasks(system.store)
            ),
            "the build finished by the next DataCoord",
        )
    for done in builds(system, data):
        assert done.files and system.storage.exists(done.files[0])
        assert done.version == (2 if done.build_id in abandoned else 1)
