"""A real producer process for the multi-writer tests (run as a script, not collected by pytest).

Settings come from the VCHAN_* environment.

python producer_child.py insert COLLECTION START_PK BATCHES ROWS [KILL_AT_BATCH FAILPOINT]
    inserts BATCHES batches of ROWS generated rows (pks from START_PK, `generate_rows` with
    seed = first pk of the batch), printing "batch I" after each. With KILL_AT_BATCH, the
    failpoint FAILPOINT is armed before that batch: the process SIGKILLs itself there.
    With FLUSH_COUNT_FILE=PATH set, after half the batches it waits until the flusher's
    count in PATH has grown: a flush then falls between this producer's batches, whatever
    the speed of either process. With GATE_FILE=PATH:I set, before batch I it waits until
    PATH exists. With DELETE_ROWS=N set, it then deletes its first N pks in one call and
    prints "deleted N". Warnings (a retry, say) are printed to stdout.
python producer_child.py flush COLLECTION INTERVAL STOP_FILE [COUNT_FILE]
    flushes every INTERVAL seconds until STOP_FILE exists, printing "flush TS" each time and
    writing the number of flushes done so far to COUNT_FILE.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from vchan_assets.config import Settings
from vchan_assets.failpoints import ENV
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage
from vchan_assets.system import System
from vchan_assets.testing.waiting import wait_until
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "f": "float", "s": "string", "b": "bool"})
FLUSH_COUNT_ENV = "FLUSH_COUNT_FILE"
GATE_ENV = "GATE_FILE"
DELETE_ENV = "DELETE_ROWS"
HANDSHAKE_TIMEOUT = 300.0  # a hang guard only: the handshake itself does not depend on speed


def flush_count(path: Path) -> int:
    return int(path.read_text()) if path.exists() else 0


def write_flush_count(path: Path, count: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(count))
    os.replace(tmp, path)  # atomic: a reader sees the old count or the new one


def wait_for_a_flush(path: Path) -> None:
    seen = flush_count(path)
    wait_until(
        lambda: flush_count(path) > seen, HANDSHAKE_TIMEOUT, f"a flush recorded in {path}", interval=0.05
    )


def gate() -> tuple[Path, int] | None:
    spec = os.environ.get(GATE_ENV)
    if not spec:
        return None
    path, _, at = spec.rpartition(":")
    return Path(path), int(at)


def insert(producer: Producer, collection: str, args: list[str]) -> None:
    start, batches, rows = int(args[0]), int(args[1]), int(args[2])
    kill_at = int(args[3]) if len(args) > 3 else -1
    flushes, wait_file = os.environ.get(FLUSH_COUNT_ENV), gate()
    for i in range(batches):
        if i == kill_at:
            os.environ[ENV] = args[4]
        if flushes and i == batches // 2:
            wait_for_a_flush(Path(flushes))
        if wait_file and i == wait_file[1]:
            path = wait_file[0]
            wait_until(path.exists, HANDSHAKE_TIMEOUT, f"{path}", interval=0.05)
        first = start + i * rows
        producer.insert(collection, generate_rows(SCHEMA, rows, start_pk=first, seed=first))
        print("batch", i, flush=True)
    deletes = int(os.environ.get(DELETE_ENV, "0"))
    if deletes:
        producer.delete(collection, list(range(start, start + deletes)))
        print("deleted", deletes, flush=True)


def flush(producer: Producer, collection: str, args: list[str]) -> None:
    interval, stop = float(args[0]), Path(args[1])
    count_file = Path(args[2]) if len(args) > 2 else None
    done = 0
    while not stop.exists():
        print("flush", producer.flush(collection), flush=True)
        done += 1
        if count_file is not None:
            write_flush_count(count_file, done)
        time.sleep(interval)


def main(mode: str, collection: str, *args: str) -> int:
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(levelname)s %(message)s")
    settings = Settings.from_env()
    store = MetaStore.connect(settings)
    producer = Producer(System(settings, store, Storage.from_settings(settings)))
    if mode == "insert":
        insert(producer, collection, list(args))
    else:
        flush(producer, collection, list(args))
    producer.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
