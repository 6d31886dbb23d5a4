"""Known data for the catalog tests: a collection produced, partly synced, with deletes."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from vchan_assets.model import CollectionInfo, CollectionSchema
from vchan_assets.system import System
from vchan_assets.testing.harness import cli_env
from vchan_assets.testing.steps import sync_all
from vchan_assets.wal.producer import Producer, generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 4}, {"n": "int64", "s": "string"})


@dataclass
class Known:
    """What was produced: rows per partition, deletes, and the rows a reader must see."""

    info: CollectionInfo
    inserted: dict[str, list[int]]  # partition name -> pks
    deleted: dict[str, list[int]]  # partition name -> pks deleted after their insert
    reinserted: list[int]  # pks inserted again (in _default) after their delete: they stay

    @property
    def visible(self) -> set[int]:
        out: set[int] = set()
        for partition, pks in self.inserted.items():
            out |= set(pks) - set(self.deleted.get(partition, []))
        return out | set(self.reinserted)


def produce_known(system: System, name: str) -> tuple[Producer, Known]:
    """600 rows in `_default`, 200 in `p1` over 2 vchannels; deletes of 50 pks in `_default`
    and 10 in `p1`; pk 0..4 re-inserted after their delete; everything synced and flushed."""
    producer = Producer(system)
    producer.create_collection(name, SCHEMA, partitions=["p1"], num_channels=2)
    producer.insert(name, generate_rows(SCHEMA, 600, start_pk=0, seed=1))
    producer.insert(name, generate_rows(SCHEMA, 200, start_pk=1000, seed=2), partition="p1")
    deleted_default = list(range(0, 50))
    deleted_p1 = list(range(1000, 1010))
    producer.delete(name, deleted_default, partition="_default")
    producer.delete(name, deleted_p1, partition="p1")
    # A delete in another partition does not touch _default's rows (per partition, as Milvus).
    producer.delete(name, [100, 101], partition="p1")
    producer.insert(name, generate_rows(SCHEMA, 5, start_pk=0, seed=3))
    producer.flush(name)
    sync_all(system, producer.collection(name))
    known = Known(
        info=producer.collection(name),
        inserted={"_default": list(range(600)), "p1": list(range(1000, 1200))},
        deleted={"_default": deleted_default, "p1": [*deleted_p1, 100, 101]},
        reinserted=list(range(5)),
    )
    return producer, known


VCHAN = Path(sys.executable).parent / "vchan"

__all__ = ["SCHEMA", "VCHAN", "Known", "cli_env", "produce_known"]
