"""WAL batches of the log tests: a collection of one vchannel and insert messages built by
hand, with time ticks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from vchan_assets.model import CollectionInfo, CollectionSchema

CHANNEL = "test-dml_0_1v0"
SCHEMA = CollectionSchema.build("pk", {"vec": 4}, {"age": "int64", "tag": "string"})
COLLECTION = CollectionInfo(1, "c", SCHEMA, (10,), (CHANNEL,), partition_names=("_default",))


def user_rows(n: int, start: int = 0) -> pa.Table:
    vectors = np.arange(start * 4, (start + n) * 4, dtype=np.float32).reshape(n, 4)
    return pa.table(
        {
            "pk": pa.array(np.arange(start, start + n, dtype=np.int64)),
            "vec": pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), n, [None, pa.py_buffer(vectors)]),
            "age": pa.array(np.arange(n, dtype=np.int64) % 7),
            "tag": pa.array([f"t{i % 3}" for i in range(n)]),
        }
    )


def batch(rows: pa.Table, ts: int, segment_id: int = 100, tick: bool = True) -> pa.Table:
    """Insert messages for `rows` at `ts`, then (optionally) a time tick at ts + 1."""
    n = rows.num_rows
    inserts = pa.table(
        {
            "msg_type": ["insert"] * n,
            "timestamp": pa.array([ts] * n, pa.int64()),
            "segment_id": pa.array([segment_id] * n, pa.int64()),
            "partition_id": pa.array([10] * n, pa.int64()),
            **{name: rows.column(name) for name in rows.column_names},
        }
    )
    if not tick:
        return inserts
    tick_row = pa.table({"msg_type": ["timetick"], "timestamp": pa.array([ts + 1], pa.int64())})
    return pa.concat_tables([inserts, tick_row], promote_options="default")
