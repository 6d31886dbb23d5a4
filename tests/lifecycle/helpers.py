"""Shared steps of the lifecycle tests: small flushed segments with deletes, and the
invariants every test checks afterwards (read back with plain pyarrow via the catalog)."""

from __future__ import annotations

import subprocess
from collections import Counter

import pyarrow as pa
from datanode.helpers import SCHEMA, VCHAN, Produced, cli_env, produce, segments

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.lifecycle.gc import segment_paths
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.wal.producer import Producer

__all__ = ["SCHEMA", "Produced", "segments"]


def sync_all(store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo) -> None:
    for vchannel in info.vchannels:
        lease = store.read_lease(vchannel) or grant_channel_lease(
            store, IdAllocator(store), vchannel, node_id=1
        )
        SyncTask(System(settings, store, storage), info, vchannel, lease, engine="local").run()


def flushed_batches(
    store: MetaStore,
    storage: Storage,
    settings: Settings,
    producer: Producer,
    info: CollectionInfo,
    batches: int,
    rows: int = 200,
    deletes: int = 10,
    first_batch: int = 0,
) -> Produced:
    """`batches` rounds of insert (+ deletes of the round's first pks), flush, sync: one
    small Flushed L1 segment per round and vchannel, one L0 segment per round."""
    produced = Produced()
    for b in range(first_batch, first_batch + batches):
        produce(producer, info.name, produced, rows, start_pk=b * 10_000, deletes=deletes)
        producer.flush(info.name)
        sync_all(store, storage, settings, info)
    return produced


def live(store: MetaStore, info: CollectionInfo) -> list[SegmentInfo]:
    return [s for s in segments(store, info) if s.state is not SegmentState.DROPPED]


def live_l1(store: MetaStore, info: CollectionInfo) -> list[SegmentInfo]:
    return [s for s in live(store, info) if s.level is not SegmentLevel.L0]


def expected_pks(produced: Produced) -> list[int]:
    deleted = set(produced.deleted)
    return sorted(pk for pk in produced.table["pk"].to_pylist() if pk not in deleted)


def assert_lifecycle_invariants(
    store: MetaStore, storage: Storage, settings: Settings, info: CollectionInfo, produced: Produced
) -> None:
    """Every live row in exactly one live segment, every delete applied, no live meta
    naming a missing file."""
    rows = Catalog(System(settings, store, storage)).read_collection(info.name, as_arrow=True)
    assert isinstance(rows, pa.Table)
    counts = Counter(rows["pk"].to_pylist())
    dup = [pk for pk, c in counts.items() if c > 1]
    assert not dup, f"pks in more than one live segment: {dup[:5]}"
    assert sorted(counts) == expected_pks(produced)
    want = produced.table.sort_by("pk")
    got = rows.sort_by("pk")
    keep = pa.array([pk in counts for pk in want["pk"].to_pylist()])
    for column in ("n", "s", "vec"):
        assert got[column].equals(want.filter(keep)[column]), f"column {column} changed"
    missing = [p for s in live(store, info) for p in segment_paths(s) if not storage.exists(p)]
    assert not missing, f"live meta names missing files: {missing[:3]}"


def run_vchan(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VCHAN), *args], env=cli_env(settings, **env), capture_output=True, text=True, timeout=300
    )


def start_datacoord(settings: Settings, engine: str = "local", **env: str) -> subprocess.Popen[bytes]:
    """A `vchan datacoord --engine {engine}` process on `settings` and the variables `env`,
    its output piped (read it with `communicate` after `terminate`)."""
    return subprocess.Popen(
        [str(VCHAN), "datacoord", "--engine", engine],
        env=cli_env(settings, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def write_twice(store: MetaStore, seg: SegmentInfo) -> SegmentInfo:
    """A second meta of `seg` under another id, naming the same binlogs: its rows live twice."""
    copy = seg.with_changes(id=seg.id + 1_000_000)
    store.put(store.keys.segment(copy.collection_id, copy.partition_id, copy.id), copy)
    return copy


def drop_without_copy(store: MetaStore, seg: SegmentInfo) -> None:
    """`seg` Dropped with nothing compacted from it: its rows (or deletes) are gone."""
    key = store.keys.segment(seg.collection_id, seg.partition_id, seg.id)
    found = store.get_model(key, SegmentInfo)
    assert found is not None
    store.cas(key, found.kv.version, found.model.with_changes(state=SegmentState.DROPPED, dropped_at=1.0))
