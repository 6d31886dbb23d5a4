"""Steps of the sync tests: `vchan sync` in its own process (stopped at a failpoint), the
state of the test's keys in etcd."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import MsgPosition
from vchan_assets.testing.harness import VCHAN, cli_env
from vchan_assets.testing.waiting import wait_stopped


def meta_state(store: MetaStore) -> set[tuple[str, int]]:
    """Every key under the test's root with the revision of its last change: the same twice
    means this test wrote nothing in between (etcd's own revision also moves when another
    test writes to the shared server)."""
    return {(kv.key, kv.mod_revision) for kv in store.list_prefix(store.keys.root + "/").items}


def checkpoint(store: MetaStore, vchannel: str) -> MsgPosition | None:
    found = store.get_model(store.keys.channel_checkpoint(vchannel), MsgPosition)
    return None if found is None else found.model


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


def sync_stopped_at(
    settings: Settings, collection: str, vchannel: str, lease_id: int, step: str, tmp_path: Path
) -> subprocess.Popen[str]:
    """`vchan sync` (local engine) in its own process, SIGSTOPped at its failpoint `step`
    (its commits so far done, the rest waiting for SIGCONT)."""
    marker = tmp_path / f"reached-{step}"
    child = start_sync_process(
        settings,
        collection,
        vchannel,
        lease_id,
        VCHAN_FAILPOINT=f"{step}=stop",
        VCHAN_FAILPOINT_MARKER=str(marker),
    )
    wait_stopped(child, marker)
    return child
