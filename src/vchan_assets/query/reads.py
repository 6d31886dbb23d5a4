"""Reading rows: one segment's, or every persisted row of a collection, as Arrow tables.

What a reader sees: the segments the query views of the collection's vchannels serve
(`query.view`: flushed and growing ones, compaction lineage resolved; never L0, Dropped
or still Importing ones, unless lineage serves a Dropped input again), those with
binlogs, with Milvus' delete rule applied per partition: a delete of primary key `pk` in
partition `p` with timestamp `t` removes every row of `p` with that pk inserted before
`t`. The deletes are the delta logs of the segments the views serve. The pandas tables of
the catalog and the Spark data source (`spark_source`) read through these rules.
"""

from __future__ import annotations

import pyarrow as pa

from vchan_assets.model import CollectionInfo, SegmentInfo, SegmentLevel
from vchan_assets.query.view import collection_segments, collection_views, delete_paths, readable_ids
from vchan_assets.storage.rows import apply_deletes_to, empty_deletes, read_deletes, read_files, segment_rows
from vchan_assets.system import System

__all__ = ["collection_segments", "read_collection", "read_segment"]


def read_segment(
    system: System, info: CollectionInfo, seg: SegmentInfo, apply_deletes: bool = True
) -> pa.Table:
    """The rows of one segment's binlogs (column groups joined on row_id): row_id,
    timestamp, the primary key, scalars and vectors (fixed_size_binary, little-endian
    float32). With `apply_deletes`, rows deleted later in the same partition are removed.
    An L0 segment returns its deletes (pk, timestamp, offset)."""
    if seg.level is SegmentLevel.L0:
        return read_files(system.storage, (b.path for b in seg.deltalogs)) or empty_deletes()
    table = segment_rows(system.storage, seg)
    if apply_deletes:
        views = collection_views(system.store, info)
        deletes = read_deletes(system.storage, delete_paths(views, seg.partition_id))
        table = apply_deletes_to(table, deletes, info.schema.primary.name)
    return table


def read_collection(
    system: System, info: CollectionInfo, apply_deletes: bool = True, with_vectors: bool = True
) -> pa.Table:
    """Every persisted row of a collection (the segments its query views serve, with
    binlogs), with `segment_id` and `partition_id` columns, deletes applied per partition."""
    segments = collection_segments(system.store, info.id)
    views = collection_views(system.store, info, segments)
    served = readable_ids(views)
    tables = []
    deletes: dict[int, pa.Table] = {}
    for seg in segments:  # in key order, as listed
        if seg.id not in served:
            continue
        table = segment_rows(system.storage, seg, with_vectors)
        if apply_deletes:
            if seg.partition_id not in deletes:
                paths = delete_paths(views, seg.partition_id)
                deletes[seg.partition_id] = read_deletes(system.storage, paths)
            table = apply_deletes_to(table, deletes[seg.partition_id], info.schema.primary.name)
        n = table.num_rows
        table = table.append_column("segment_id", pa.array([seg.id] * n, pa.int64()))
        table = table.append_column("partition_id", pa.array([seg.partition_id] * n, pa.int64()))
        tables.append(table)
    if tables:
        return pa.concat_tables(tables)
    return pa.table({info.schema.primary.name: pa.array([], pa.int64())})
