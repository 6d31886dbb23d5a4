"""Known data for the index tests: a collection of clustered 16-d vectors in a few sorted
segments, small enough that every build takes well under a second."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from vchan_assets.indexes.meta import create_index, list_builds
from vchan_assets.indexes.step import index_step
from vchan_assets.lifecycle.step import sort_step
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentIndex, SegmentInfo, SegmentState
from vchan_assets.system import System
from vchan_assets.testing.harness import segments
from vchan_assets.testing.steps import new_collection, start_datacoord, sync_all
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer

DIM = 16
SCHEMA = CollectionSchema.build("pk", {"vec": DIM}, {"n": "int64", "tag": "string"})
CENTERS = np.random.default_rng(42).normal(0.0, 4.0, (24, DIM)).astype(np.float32)


def clustered(n: int, seed: int) -> np.ndarray:
    """`n` vectors around 24 fixed centers (what real embeddings look like to an index)."""
    rng = np.random.default_rng(seed)
    around = CENTERS[rng.integers(0, len(CENTERS), n)]
    return (around + rng.normal(0.0, 1.0, (n, DIM))).astype(np.float32)


@dataclass
class Data:
    """What was inserted: pk -> vector, and the pks deleted since."""

    info: CollectionInfo
    pks: list[int] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)
    deleted: set[int] = field(default_factory=set)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(pks, vectors) of the rows not deleted."""
        pks = np.asarray(self.pks, dtype=np.int64)
        vectors = np.concatenate(self.vectors) if self.vectors else np.empty((0, DIM), np.float32)
        keep = ~np.isin(pks, list(self.deleted))
        return pks[keep], vectors[keep]


def new_data(producer: Producer, channels: int = 1) -> Data:
    """A new collection of `SCHEMA` (nothing inserted yet)."""
    return Data(new_collection(producer, channels, SCHEMA, prefix="i"))


def insert(producer: Producer, data: Data, n: int, start_pk: int) -> None:
    vectors = clustered(n, seed=start_pk)
    pks = np.arange(start_pk, start_pk + n, dtype=np.int64)
    rows = pa.table(
        {
            "pk": pa.array(pks),
            "vec": pa.FixedSizeBinaryArray.from_buffers(pa.binary(DIM * 4), n, [None, pa.py_buffer(vectors)]),
            "n": pa.array(pks % 7),
            "tag": pa.array([f"t{p % 3}" for p in pks.tolist()]),
        }
    )
    producer.insert(data.info.name, rows)
    data.pks += pks.tolist()
    data.vectors.append(vectors)


def flushed_segments(system: System, producer: Producer, data: Data, sizes: list[int]) -> None:
    """One flushed and synced segment, not sorted yet (per vchannel), of each size in `sizes`."""
    for size in sizes:
        insert(producer, data, size, start_pk=len(data.pks) and max(data.pks) + 1)
        producer.flush(data.info.name)
        sync_all(system, data.info)


def sorted_segments(system: System, producer: Producer, data: Data, sizes: list[int]) -> None:
    """One flushed, synced and sorted segment (per vchannel) of each size in `sizes`."""
    flushed_segments(system, producer, data, sizes)
    sort_step(system, engine="local")


def ivf_indexed(
    system: System, producer: Producer, data: Data, sizes: list[int], build: bool = False
) -> None:
    """Sorted segments of `sizes` and an IVF_FLAT index (nlist 8) of `vec`; `build`: their
    builds run too (`index_step`)."""
    sorted_segments(system, producer, data, sizes)
    create_index(system.store, data.info, "vec", "IVF_FLAT", "L2", {"nlist": 8})
    if build:
        index_step(system, "local")


def vectors_lost(system: System, data: Data, seg: SegmentInfo) -> dict[str, bytes]:
    """The files of `seg`'s `vec` column group deleted (its builds fail: "vectors
    unreadable"); returns them by path, to write back."""
    field_id = data.info.schema.field("vec").field_id
    group = next(g for g in seg.binlogs if field_id in g.field_ids)
    saved = {b.path: system.storage.read_bytes(b.path) for b in group.logs}
    for path in saved:
        system.storage.delete(path)
    return saved


def live_sorted(system: System, info: CollectionInfo) -> list[SegmentInfo]:
    """The flushed, sorted segments of `info` (read through `harness.segments`, the tests'
    one listing of a collection's segment meta)."""
    return [s for s in segments(system.store, info) if s.state is SegmentState.FLUSHED and s.is_sorted]


def exact_neighbours(data: Data, queries: np.ndarray, k: int) -> list[set[int]]:
    """The true k nearest live pks (squared L2) of each query."""
    pks, vectors = data.live()
    d = ((queries[:, None, :] - vectors[None, :, :]) ** 2).sum(-1)
    return [set(pks[np.argsort(row, kind="stable")[:k]].tolist()) for row in d]


class Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def builds(system: System, data: Data) -> list[SegmentIndex]:
    """The index builds of the collection, by build id."""
    return sorted((d.model for d in list_builds(system.store, data.info.id)), key=lambda b: b.build_id)


# A DataCoord process that only runs tasks: no lifecycle step, sort scan or compaction check
# of its own within a test, a failed task retried after 1 s.
QUIET = {
    "VCHAN_LIFECYCLE_INTERVAL": "3600",
    "VCHAN_SORT_SCAN_INTERVAL": "3600",
    "VCHAN_COMPACTION_CHECK_INTERVAL": "3600",
    "VCHAN_TASK_RETRY_BACKOFF": "1",
}
PATIENCE = 60.0  # seconds


@contextmanager
def datacoord(system: System, engine: str = "local", **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """A `vchan datacoord` process on `system`'s settings (QUIET, and `env`), stopped on exit."""
    process = start_datacoord(system.settings, engine, **QUIET, **env)
    try:
        yield process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)  # (if a test left it stopped)
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for(process: subprocess.Popen[bytes], done: Callable[[], bool], what: str) -> None:
    """Wait until `done()` while `process` lives; on timeout, stop it and show its output."""

    def check() -> bool:
        assert process.poll() is None, process.communicate()[0].decode()[-3000:]
        return done()

    def output() -> str:
        process.terminate()
        return process.communicate()[0].decode()[-3000:]

    wait_until(check, PATIENCE, what, interval=0.2, describe=output)
