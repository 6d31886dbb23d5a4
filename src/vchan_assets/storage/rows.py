"""Reading a segment's rows back and applying deletes: shared by compaction and the catalog."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.fields import arrow_type, vector_matrix
from vchan_assets.model import FieldSchema, SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage

DELETE_COLUMNS = ["pk", "timestamp"]


def read_files(storage: Storage, paths: Iterable[str], columns: list[str] | None = None) -> pa.Table | None:
    tables = [storage.read_parquet(p, columns=columns) for p in paths]
    return pa.concat_tables(tables) if tables else None


def empty_deletes() -> pa.Table:
    return pa.table({"pk": pa.array([], pa.int64()), "timestamp": pa.array([], pa.int64())})


def concat_deletes(tables: Sequence[pa.Table]) -> pa.Table:
    """(pk, timestamp) tables as one. Empty ones are left out: an empty table's pk is
    int64 (`empty_deletes`), which a VarChar collection's deletes would not concatenate with."""
    found = [t for t in tables if t.num_rows]
    if not found:
        return tables[0] if tables else empty_deletes()
    return pa.concat_tables(found, promote_options="permissive")


def read_deletes(storage: Storage, paths: Iterable[str]) -> pa.Table:
    """The (pk, timestamp) rows of the delta logs `paths`, ready for `apply_deletes_to`
    (no paths: no deletes)."""
    found = read_files(storage, paths, columns=DELETE_COLUMNS)
    return found if found is not None else empty_deletes()


def segment_rows(storage: Storage, seg: SegmentInfo, with_vectors: bool = True) -> pa.Table:
    """The rows of one L1 segment: its column groups joined on row_id (they are aligned)."""
    groups = sorted(seg.binlogs, key=lambda g: g.group)
    scalar = read_files(storage, (b.path for b in groups[0].logs)) if groups else None
    if scalar is None:
        return pa.table({"row_id": pa.array([], pa.int64())})
    for group in groups[1:] if with_vectors else ():
        vectors = read_files(storage, (b.path for b in group.logs))
        if vectors is None:
            continue
        if not vectors["row_id"].equals(scalar["row_id"]):
            raise ValueError(f"segment {seg.id}: column group {group.group} is not aligned with group 0")
        for name in vectors.column_names:
            if name != "row_id":
                scalar = scalar.append_column(name, vectors[name])
    return scalar


def float_vectors(column: pa.Array | pa.ChunkedArray, dim: int) -> np.ndarray:
    """fixed_size_binary(dim*4) little-endian float32 -> a (rows, dim) float32 matrix,
    without Python rows (a null vector reads as whatever its bytes hold: zeros)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    data = arr.buffers()[1]
    start = arr.offset * dim
    if not data or not len(arr):
        return np.empty((0, dim), dtype="<f4")
    return np.frombuffer(data, dtype="<f4", count=start + len(arr) * dim)[start:].reshape(len(arr), dim)


def segment_vectors(storage: Storage, seg: SegmentInfo, field: FieldSchema) -> np.ndarray:
    """The vectors of one field of an L1 segment, in the segment's row order (its column
    group is aligned with group 0), as `fields.vector_matrix` reads them: a (rows, dim)
    float32 matrix (float16 and bfloat16 vectors widened), or binary vectors' (rows, dim / 8)
    uint8 bytes."""
    assert field.dim is not None
    found = segment_column(storage, seg, field)
    if found is None:
        return vector_matrix(field, pa.nulls(0, arrow_type(field)))
    return vector_matrix(field, found)


def segment_column(storage: Storage, seg: SegmentInfo, field: FieldSchema) -> pa.ChunkedArray | None:
    """One field's column of an L1 segment as stored, read from its column group alone, in
    the segment's row order (None: the segment has no files of it)."""
    group = next((g for g in seg.binlogs if field.field_id in g.field_ids), None)
    found = read_files(storage, (b.path for b in group.logs), columns=[field.name]) if group else None
    return None if found is None else found[field.name]


def unexpired(table: pa.Table, before: int) -> pa.Table:
    """The rows inserted at or after `before` (`CollectionInfo.expired_before` of the read's
    time: the rows of a collection with a TTL that have not expired; 0 keeps every row).
    Deletes are not filtered: an expired row's delete removes nothing that is read."""
    if not before or table.num_rows == 0:
        return table
    keep = pc.greater_equal(table["timestamp"], before)
    return table if pc.all(keep).as_py() else table.filter(keep)


def readable(seg: SegmentInfo) -> bool:
    """A segment whose rows a collection read returns: L1/L2 with binlogs, neither Dropped
    nor still Importing (an import's segments appear together when its job commits)."""
    return (
        seg.level is not SegmentLevel.L0
        and seg.state not in (SegmentState.DROPPED, SegmentState.IMPORTING)
        and bool(seg.binlogs)
    )


def delete_paths(segments: Sequence[SegmentInfo], partition_id: int) -> list[str]:
    """Delta logs that apply to a partition: those of its segments that are neither Dropped
    nor still Importing (an upsert's deletes apply once its job commits, with its rows: a
    read or a compaction that applied them before would lose the rows they replace if
    the import then fails)."""
    return delete_paths_by_partition(segments).get(partition_id, [])


def delete_paths_by_partition(segments: Sequence[SegmentInfo]) -> dict[int, list[str]]:
    """`delete_paths` of every partition that has any, in one pass over `segments`."""
    out: dict[int, list[str]] = {}
    for seg in segments:
        if seg.deltalogs and seg.state not in (SegmentState.DROPPED, SegmentState.IMPORTING):
            out.setdefault(seg.partition_id, []).extend(b.path for b in seg.deltalogs)
    return out


def apply_deletes_to(rows: pa.Table, deletes: pa.Table, pk: str) -> pa.Table:
    """Rows minus those deleted later: a row goes if a delete of its pk has a timestamp
    greater than the row's (Milvus' rule; `deletes` holds one partition's pk, timestamp)."""
    if deletes.num_rows == 0 or rows.num_rows == 0:
        return rows
    grouped = deletes.group_by("pk").aggregate([("timestamp", "max")])
    # Each row's pk looked up in the deleted pks (a hash of the deletes, probed in row order):
    # no join, so no sort to restore the order and no take of every column afterwards.
    found = pc.index_in(rows[pk], value_set=grouped["pk"])
    deleted_ts = grouped["timestamp_max"].take(found)
    keep = pc.or_kleene(pc.is_null(deleted_ts), pc.less_equal(deleted_ts, rows["timestamp"]))
    return rows if pc.all(keep).as_py() else rows.filter(keep)
