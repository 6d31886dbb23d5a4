"""Getting past a damaged log file or binlog (`vchan quarantine`, `wal.quarantine`,
`lifecycle.quarantine`): a real truncated WAL file or binlog, real `vchan sync`,
`vchan quarantine` and `vchan status` processes."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pyarrow.compute as pc
import pytest

from vchan_assets.catalog import Catalog
from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, MsgPosition, SegmentLevel, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.harness import (
    SCHEMA,
    VCHAN,
    Produced,
    cli_env,
    live_segments,
    produce,
    read_inserted,
    segments,
)
from vchan_assets.wal.producer import Producer
from vchan_assets.wal.quarantine import NotDamagedError, inspect_log_file
from vchan_assets.wal.reader import WalReader


def _vchan(settings: Settings, *args: str, answer: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VCHAN), *args], env=cli_env(settings), input=answer, capture_output=True, text=True, timeout=300
    )


def _sync(settings: Settings, info: CollectionInfo) -> subprocess.CompletedProcess[str]:
    return _vchan(settings, "sync", "--collection", info.name, "--take-lease", "--engine", "local")


def _truncate(storage: Storage, info: CollectionInfo, vchannel: str) -> tuple[Path, int, int]:
    """Truncate the channel's first insert batch; its path and offsets."""
    victim = WalReader(storage, vchannel, info).files()[1]  # 0 is create_collection
    path = Path(storage.path(victim.key))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path, victim.first_offset, victim.last_offset


def test_a_quarantined_log_file_lets_its_channel_sync_on_and_the_loss_stays_visible(
    system: System, storage: Storage, settings: Settings, producer: Producer, collection: CollectionInfo
) -> None:
    produced = Produced()
    produce(producer, collection.name, produced, 400, start_pk=0)
    damaged_channel = collection.vchannels[0]
    path, first, last = _truncate(storage, collection, damaged_channel)
    assert _sync(settings, collection).returncode == 5

    refused = _vchan(settings, "quarantine", "--file", str(path), answer="no\n")
    assert refused.returncode == 1 and f"offsets {first}..{last}" in refused.stdout, refused.stdout
    assert path.read_bytes() and not Path(storage.path(f"quarantine/{storage.key_of(str(path))}")).exists()

    done = _vchan(settings, "quarantine", "--file", str(path), answer="yes\n")
    assert done.returncode == 0, done.stderr[-2000:]
    kept = Path(storage.path(f"quarantine/{storage.key_of(str(path))}"))
    assert kept.stat().st_size > 0
    produce(producer, collection.name, produced, 400, start_pk=400)

    synced = _sync(settings, collection)

    assert synced.returncode == 0, synced.stderr[-2000:]
    found = system.store.get_model(system.store.keys.channel_checkpoint(damaged_channel), MsgPosition)
    assert found is not None and found.model == WalReader(storage, damaged_channel, collection).head()
    persisted = set(read_inserted(system.store, storage, collection)["pk"].to_pylist())
    lost = {pk for pk in produced.table["pk"].to_pylist() if pk not in persisted}
    # Only rows of the damaged file are lost: the first batch's rows of that channel.
    first_batch = produced.rows[0]["pk"]
    assert lost == set(first_batch.filter(pc.equal(pc.bit_wise_and(first_batch, 1), 0)).to_pylist())
    status = _vchan(settings, "status", "--json")
    report = json.loads(status.stdout)
    [loss] = report["data_losses"]
    assert (loss["vchannel"], loss["first_offset"], loss["last_offset"]) == (damaged_channel, first, last)
    assert any(w["kind"] == "data_lost" and str(path) in w["message"] for w in report["warnings"])
    with Catalog(system) as catalog:
        assert catalog.data_losses(collection.name)["messages"].tolist() == [last - first + 1]


def test_a_readable_log_file_is_not_quarantined(
    system: System, storage: Storage, producer: Producer, collection: CollectionInfo
) -> None:
    produce(producer, collection.name, Produced(), 100, start_pk=0)
    healthy = WalReader(storage, collection.vchannels[0], collection).files()[1]

    with pytest.raises(NotDamagedError, match="it reads"):
        inspect_log_file(system, storage.path(healthy.key))


def test_a_quarantined_binlog_leaves_its_segment_the_rows_of_its_other_files_and_records_the_loss(
    system: System, store: MetaStore, storage: Storage, settings: Settings, producer: Producer
) -> None:
    info = producer.create_collection(f"c{uuid.uuid4().hex[:8]}", SCHEMA, num_channels=1)
    lease = grant_channel_lease(store, IdAllocator(store), info.vchannels[0], node_id=1)
    first, second = Produced(), Produced()
    produce(producer, info.name, first, 300, start_pk=0)
    SyncTask(system, info, info.vchannels[0], lease, engine="local").run()
    produce(producer, info.name, second, 200, start_pk=1000)
    producer.flush(info.name)
    SyncTask(system, info, info.vchannels[0], lease, engine="local").run()
    [seg] = [s for s in live_segments(segments(store, info)) if s.level is SegmentLevel.L1]
    assert seg.state is SegmentState.FLUSHED and len(seg.binlogs[0].logs) == 2
    victim = Path(storage.path(seg.binlogs[0].logs[0].path))
    victim.write_bytes(victim.read_bytes()[:100])

    done = _vchan(settings, "quarantine", "--file", str(victim), "--yes")

    assert done.returncode == 0, done.stderr[-2000:]
    assert "300 of the 500 rows" in done.stdout
    with Catalog(system) as catalog:
        kept = catalog.read_segment(seg.id, as_arrow=True)
        assert sorted(kept["pk"].to_pylist()) == sorted(second.table["pk"].to_pylist())
        [loss] = catalog.data_losses(info.name).to_dict("records")
    assert (loss["kind"], loss["segment_id"], loss["rows"], loss["path"]) == (
        "binlog",
        seg.id,
        300,
        str(victim),
    )
    report = json.loads(_vchan(settings, "status", "--json").stdout)
    assert any(w["kind"] == "data_lost" and "300 rows lost" in w["message"] for w in report["warnings"])
