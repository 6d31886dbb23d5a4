"""Shared steps of the sync tests: produce known data, run syncs, read binlogs back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, MsgPosition, SegmentInfo, SegmentLevel
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "f": "float", "s": "string", "b": "bool"})
VCHAN = Path(sys.executable).parent / "vchan"


@dataclass
class Produced:
    """What a test wrote into the log, to compare the binlogs against."""

    rows: list[pa.Table] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)

    @property
    def table(self) -> pa.Table:
        return pa.concat_tables(self.rows)


def produce(
    producer: Producer, name: str, produced: Produced, n: int, start_pk: int, deletes: int = 0
) -> None:
    rows = generate_rows(SCHEMA, n, start_pk=start_pk, seed=start_pk)
    producer.insert(name, rows)
    produced.rows.append(rows)
    if deletes:
        pks = list(range(start_pk, start_pk + deletes))
        producer.delete(name, pks, partition="_default")
        produced.deleted.extend(pks)


def segments(store: MetaStore, info: CollectionInfo) -> list[SegmentInfo]:
    found, _ = store.list_models(store.keys.segments(info.id), SegmentInfo)
    return [d.model for d in found]


def read_inserted(store: MetaStore, storage: Storage, info: CollectionInfo) -> pa.Table:
    """Every row of every L1 segment's binlogs, scalar group joined with the vector group,
    read with plain pyarrow (as any engine could)."""
    tables = []
    for seg in segments(store, info):
        if seg.level is SegmentLevel.L0:
            continue
        groups = {g.group: g for g in seg.binlogs}
        for scalar_log, vector_log in zip(groups[0].logs, groups[max(groups)].logs, strict=True):
            scalars = pq.read_table(storage.path(scalar_log.path), filesystem=storage.filesystem)
            vectors = pq.read_table(storage.path(vector_log.path), filesystem=storage.filesystem)
            assert scalars["row_id"].equals(vectors["row_id"]), "column groups are not aligned"
            tables.append(scalars.append_column("vec", vectors["vec"]))
    return pa.concat_tables(tables) if tables else pa.table({"pk": pa.array([], pa.int64())})


def read_deleted(store: MetaStore, storage: Storage, info: CollectionInfo) -> list[int]:
    pks: list[int] = []
    for seg in segments(store, info):
        for delta in seg.deltalogs:
            pks += pq.read_table(storage.path(delta.path), filesystem=storage.filesystem)["pk"].to_pylist()
    return pks


def assert_exactly_once(store: MetaStore, storage: Storage, info: CollectionInfo, produced: Produced) -> None:
    """Every produced row in exactly one binlog with its values; every delete in a delta log once."""
    got = read_inserted(store, storage, info)
    counts = Counter(got["pk"].to_pylist())
    duplicates = {pk: c for pk, c in counts.items() if c > 1}
    assert not duplicates, f"{len(duplicates)} pks persisted more than once, e.g. {list(duplicates)[:5]}"
    expected = produced.table
    assert sorted(counts) == sorted(expected["pk"].to_pylist())
    by_pk = got.sort_by("pk")
    want = expected.sort_by("pk")
    for column in ("pk", "n", "f", "s", "b", "vec"):
        assert by_pk[column].equals(want[column]), f"column {column} differs from what was produced"
    assert sorted(read_deleted(store, storage, info)) == sorted(produced.deleted)


def checkpoint(store: MetaStore, vchannel: str) -> MsgPosition | None:
    found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    return None if found is None else found.model


def cli_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(
        VCHAN_ETCD_ENDPOINTS=",".join(settings.etcd_endpoints or ()),
        VCHAN_ROOT=settings.root,
        VCHAN_STORAGE_URI=settings.storage_uri,
        VCHAN_HOME=str(settings.home),
        VCHAN_SPARK_PARTITIONS=str(settings.spark_partitions),
        VCHAN_SYNC_IN_PROCESS_MB=str(settings.sync_in_process_mb),
    )
    if settings.s3_endpoint:
        env["VCHAN_S3_ENDPOINT"] = settings.s3_endpoint
        for key in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_EC2_METADATA_DISABLED",
        ):
            if key in os.environ:
                env[key] = os.environ[key]
    env.update(extra)
    return env


def run_sync_process(
    settings: Settings, collection: str, vchannel: str, lease_id: int, engine: str = "spark", **env: str
) -> subprocess.CompletedProcess[str]:
    """`vchan sync` in its own OS process (so a failpoint can SIGKILL it for real)."""
    args = [str(VCHAN), "sync", "--collection", collection, "--channel", vchannel]
    args += ["--lease-id", str(lease_id), "--engine", engine]
    return subprocess.run(args, env=cli_env(settings, **env), capture_output=True, text=True, timeout=300)


def start_sync_process(
    settings: Settings, collection: str, vchannel: str, lease_id: int, engine: str = "local", **env: str
) -> subprocess.Popen[str]:
    args = [str(VCHAN), "sync", "--collection", collection, "--channel", vchannel]
    args += ["--lease-id", str(lease_id), "--engine", engine]
    return subprocess.Popen(
        args, env=cli_env(settings, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_stopped(proc: subprocess.Popen[str], marker: Path, timeout: float = 120) -> None:
    """Wait until the child reached its `=stop` failpoint (marker written, state T)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"child exited early: {proc.returncode} {proc.stderr.read() if proc.stderr else ''}"
            )
        if marker.exists():
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "T":
                    return
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    raise AssertionError("child never reached its failpoint")
