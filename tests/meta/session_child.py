"""A real node process for the session tests (run as a script, not collected by pytest).

python session_child.py session ENDPOINT ROOT NODE_ID TTL MARKER
    registers a DataNode session, prints "registered LEASE", and when it loses liveness
    writes the reason to MARKER, prints "expired" and exits 0 (exit 3 if that never happens).
python session_child.py elect ENDPOINT ROOT NODE_ID TTL -
    campaigns for the DataCoord key, prints "leader LEASE" and then lives until killed.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.meta.session import Election, Session
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import NodeSession


def main(mode: str, endpoint: str, root: str, node_id: str, ttl: str, marker: str) -> int:
    settings = replace(Settings(), etcd_endpoints=(endpoint,), root=root, etcd_timeout=2.0)
    store = MetaStore.connect(settings)
    node = NodeSession(int(node_id), f"127.0.0.1:{node_id}", "test", time.time())
    if mode == "elect":
        election = Election(store, node, float(ttl))
        election.campaign()
        assert election.session is not None
        print("leader", election.session.lease_id, flush=True)
        threading.Event().wait()
        return 0
    lost = threading.Event()
    session = Session.for_datanode(store, node, float(ttl), on_expired=lost.set).register()
    print("registered", session.lease_id, flush=True)
    if not lost.wait(60):
        return 3
    Path(marker).write_text(session.expiry_reason or "expired")
    print("expired", flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:7]))
