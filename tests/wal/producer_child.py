"""A real producer process for the multi-writer tests (run as a script, not collected by pytest).

Settings come from the VCHAN_* environment.

python producer_child.py insert COLLECTION START_PK BATCHES ROWS [KILL_AT_BATCH FAILPOINT]
    inserts BATCHES batches of ROWS generated rows (pks from START_PK, `generate_rows` with
    seed = first pk of the batch), printing "batch I" after each. With KILL_AT_BATCH, the
    failpoint FAILPOINT is armed before that batch: the process SIGKILLs itself there.
python producer_child.py flush COLLECTION INTERVAL STOP_FILE
    flushes every INTERVAL seconds until STOP_FILE exists, printing "flush TS" each time.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.failpoints import ENV
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "f": "float", "s": "string", "b": "bool"})


def main(mode: str, collection: str, *args: str) -> int:
    settings = Settings.from_env()
    store = MetaStore.connect(settings)
    producer = Producer(store, Storage.from_settings(settings), settings)
    if mode == "insert":
        start, batches, rows = int(args[0]), int(args[1]), int(args[2])
        kill_at = int(args[3]) if len(args) > 3 else -1
        for i in range(batches):
            if i == kill_at:
                os.environ[ENV] = args[4]
            first = start + i * rows
            producer.insert(collection, generate_rows(SCHEMA, rows, start_pk=first, seed=first))
            print("batch", i, flush=True)
    else:
        interval, stop = float(args[0]), Path(args[1])
        while not stop.exists():
            print("flush", producer.flush(collection), flush=True)
            time.sleep(interval)
    producer.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
