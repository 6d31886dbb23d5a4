"""The `vchan` command end to end: real subprocesses against the shared etcd."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pyarrow.compute as pc

from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.meta.embedded import EmbeddedEtcd
from vchan_assets.meta.store import MetaStore
from vchan_assets.storage import Storage
from vchan_assets.wal import WalReader


def vchan(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vchan_assets.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def cli_env(etcd: EmbeddedEtcd, tmp_path: Path, root: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCHAN_")}
    env.update(
        VCHAN_ETCD_ENDPOINTS=etcd.endpoint,
        VCHAN_ROOT=root,
        VCHAN_STORAGE_URI=str(tmp_path / "storage"),
        VCHAN_HOME=str(tmp_path / "home"),
    )
    return env


def test_produce_writes_rows_deletes_and_ticks_end_to_end(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    root = f"cli-{uuid.uuid4().hex[:8]}"
    env = cli_env(etcd, tmp_path, root)

    created = vchan(env, "create-collection", "--collection", "demo", "--dim", "16", "--shards", "2")
    assert created.returncode == 0, created.stderr
    produced = vchan(
        env, "produce", "--collection", "demo", "--rows", "2500", "--batch", "1000", "--deletes", "7"
    )
    assert produced.returncode == 0, produced.stderr
    assert "inserted 2500 rows" in produced.stdout

    settings = replace(Settings(), root=root, etcd_endpoints=(etcd.endpoint,))
    store = MetaStore.connect(settings)
    try:
        info = CollectionRegistry(store).get_by_name("demo")
    finally:
        store.close()
    storage = Storage(str(tmp_path / "storage"))
    inserts = deletes = 0
    for vchannel in info.vchannels:
        reader = WalReader(storage, vchannel, info)
        log = reader.read()
        kinds = log["msg_type"]
        inserts += pc.sum(pc.equal(kinds, "insert")).as_py()
        deletes += pc.sum(pc.equal(kinds, "delete")).as_py()
        # create_collection, 3 insert batches, one delete batch if any pk routed here
        has_deletes = pc.any(pc.equal(kinds, "delete")).as_py()
        assert len(reader.files()) == 1 + 3 + int(has_deletes)
        head = reader.head()
        assert head is not None and head.offset == log["offset"][-1].as_py()
        assert kinds[-1].as_py() == "timetick"
    assert (inserts, deletes) == (2500, 7)


def test_a_second_create_of_the_same_collection_fails_unless_asked_not_to(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    env = cli_env(etcd, tmp_path, f"cli-{uuid.uuid4().hex[:8]}")
    assert vchan(env, "create-collection", "--collection", "demo").returncode == 0

    again = vchan(env, "create-collection", "--collection", "demo")
    assert again.returncode == 1 and "already exists" in again.stderr
    assert vchan(env, "create-collection", "--collection", "demo", "--if-not-exists").returncode == 0
    missing = vchan(env, "produce", "--collection", "nope", "--rows", "5")
    assert missing.returncode == 1 and "no collection" in missing.stderr


def test_a_bad_setting_prints_the_message_and_exits_2(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    env = cli_env(etcd, tmp_path, "cli-bad")
    env["VCHAN_SEGMENT_MAX_SIZE_MB"] = "-5"

    result = vchan(env, "produce", "--collection", "demo", "--rows", "10")

    assert result.returncode == 2
    assert "VCHAN_SEGMENT_MAX_SIZE_MB" in result.stderr
