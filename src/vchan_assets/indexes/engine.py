"""Index engine versions (Milvus' indexEngineVersionManager): which index files a
process can load, and which version a build writes.

The engine version names the format of an index file: faiss's major.minor (a newer faiss
may write what an older one cannot read; faiss reads the files of older ones) and our
layout (`index_files/{build}/{version}/index.faiss`, `faiss.serialize_index`, ids = the
rows' positions in the segment). Bump `ENGINE_CURRENT` when either changes, and keep
`ENGINE_MINIMAL` at the oldest version this code still loads.

- Every process that loads indexes (a `Catalog` or `vchan search` that searches, the
  Dagster index checks) states the versions it reads in its session
  (`session/reader/{host}:{pid}:{id}`, a `NodeSession` with `index_engine`, on an etcd
  lease: `reader_session`).
- A build writes the lowest `current` stated by a live session, or the builder's own
  `current` when none states one; never below the builder's `minimal` (a reader that old
  then searches exactly). So during a rolling upgrade new builds stay readable by the old
  readers still running, and `vchan index --upgrade` rebuilds what is older once they are
  gone.
- Each build records its version (`SegmentIndex.engine`); a reader that cannot load it
  (outside its [minimal, current]) searches that segment exactly and says so.

A sparse field's index (`index.sparse.npz`, `indexes.sparse`) is version 1 too: no reader
older than sparse fields exists. There is one file layout so far, version 1: a build "for" an older version within the
builder's range writes the same bytes; the version it records is what readers check.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import faiss

from vchan_assets import __version__
from vchan_assets.meta.session import Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import IndexEngine, NodeSession, SegmentIndex, SessionState

ENGINE_CURRENT = 1
ENGINE_MINIMAL = 1
# The faiss major.minor each version's files are written with (a test ties the installed
# faiss to ENGINE_CURRENT's: upgrading faiss means a new engine version).
ENGINE_FAISS = {1: "1.15"}
# Builds recorded before versions were: all of them were version 1.
UNRECORDED = 1

OURS = IndexEngine(ENGINE_CURRENT, ENGINE_MINIMAL)


def faiss_series() -> str:
    """The installed faiss's major.minor."""
    return ".".join(faiss.__version__.split(".")[:2])


def build_engine(b: SegmentIndex) -> int:
    """The engine version a build's file was written for."""
    return b.engine or UNRECORDED


def unreadable_reason(b: SegmentIndex, engine: IndexEngine) -> str | None:
    """Why a reader of `engine` cannot load the build's file (None: it can)."""
    version = build_engine(b)
    if engine.reads(version):
        return None
    return f"engine version {version}, this process reads {engine.minimal} to {engine.current}"


def stated_engines(store: MetaStore) -> list[IndexEngine]:
    """The index engine versions stated by the live sessions (datanodes, the DataCoord and
    readers: whichever states one)."""
    found, _ = store.list_models(store.keys.sessions(), NodeSession, skip_malformed=True)
    return [d.model.index_engine for d in found if d.model.index_engine is not None]


def target_engine(store: MetaStore, builder: IndexEngine = OURS) -> int:
    """The version a build writes: the lowest current stated in a live session (the
    builder's own without any), not below what the builder can write."""
    currents = [e.current for e in stated_engines(store)]
    lowest = min([*currents, builder.current])
    return max(lowest, builder.minimal)


def reader_session(store: MetaStore, ttl: float, engine: IndexEngine = OURS) -> Session:
    """A registered session stating that this process loads indexes of `engine`'s versions;
    close it when the process stops searching."""
    host, pid = socket.gethostname(), os.getpid()
    record = NodeSession(
        pid, f"{host}:{pid}", __version__, time.time(), SessionState.HEALTHY, index_engine=engine
    )
    key = store.keys.reader_session(f"{host}:{pid}:{uuid.uuid4().hex[:8]}")
    return Session(store, key, record, ttl).register()
