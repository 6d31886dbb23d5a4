"""Checks of a completed import job, usable without Dagster (the `imported_segments`
asset reports them):

- `check_rows_match_files`: the rows in the input files (counted again, from the Parquet
  footers or by reading the text files) equal the rows in the job's segments (the entries
  of their scalar-group binlogs, as the binlog files' own footers say).
- `check_no_existing_pks`: no imported primary key was already live in the collection
  (rows of other segments, deletes applied); upsert jobs replace such rows instead.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datanode.checks import CheckOutcome
from vchan_assets.imports.files import FileSource, ImportInputError, parquet_file, read_batches
from vchan_assets.imports.jobs import KEY_PARTITIONS, ImportFormat, ImportJob
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentInfo, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.storage.rows import apply_deletes_to, delete_paths, read_deletes, read_files, readable


def _job_segments(store: MetaStore, job: ImportJob) -> list[SegmentInfo]:
    found = SegmentMeta(store).list(job.collection_id, include_dropped=True)  # compacted ones too
    return [d.model for d in found if d.model.id in job.segment_ids]


def _file_rows(source: FileSource, job: ImportJob, path: str) -> int:
    if job.format is ImportFormat.PARQUET:
        return int(parquet_file(source, path).metadata.num_rows)
    return sum(b.num_rows for b in read_batches(source, path, job.format))


def check_rows_match_files(
    store: MetaStore, storage: Storage, source: FileSource, job: ImportJob
) -> CheckOutcome:
    try:
        in_files = sum(_file_rows(source, job, f.path) for f in job.files)
    except ImportInputError as exc:
        return CheckOutcome(False, f"an input file cannot be counted again: {exc}", {"files": len(job.files)})
    segments = _job_segments(store, job)
    in_segments = 0
    for seg in segments:
        for group in seg.binlogs[:1]:
            for b in group.logs:
                with storage.open_input_file(b.path) as f:
                    in_segments += pq.ParquetFile(f).metadata.num_rows
    flushed = all(s.state is SegmentState.FLUSHED for s in segments) and len(segments) == len(job.segment_ids)
    return CheckOutcome(
        in_files == in_segments and flushed,
        f"{in_files} rows in {len(job.files)} files, {in_segments} in {len(segments)} imported segments"
        + ("" if flushed else " (not all Flushed)"),
        {"rows_in_files": in_files, "rows_in_segments": in_segments, "segments": len(segments)},
    )


def check_no_existing_pks(store: MetaStore, storage: Storage, job: ImportJob) -> CheckOutcome:
    info = CollectionRegistry(store).get(job.collection_id, include_dropped=True)
    pk = info.schema.primary.name
    found = SegmentMeta(store).list(job.collection_id, include_dropped=True)
    every = [d.model for d in found]
    mine = {s.id for s in every if s.id in job.segment_ids}
    imported = read_files(
        storage, [b.path for s in every if s.id in mine and s.binlogs for b in s.binlogs[0].logs], [pk]
    )
    # The job's partition, or with a partition key every hidden one (a row's older version
    # may be in another partition than the one its key picks now).
    partitions = info.partitions if job.partition_id == KEY_PARTITIONS else (job.partition_id,)
    live = [_live_pks(storage, every, mine, p, pk, job.timestamp) for p in partitions]
    if imported is None:
        return CheckOutcome(True, "no imported rows", {"overlap": 0})
    overlap = sum(
        int(pc.sum(pc.is_in(imported[pk], value_set=pks)).as_py() or 0) for pks in live if pks is not None
    )
    return CheckOutcome(
        overlap == 0 or job.upsert,
        f"{overlap} of {imported.num_rows} imported primary keys were already live in the "
        + ("collection" if job.partition_id == KEY_PARTITIONS else "partition")
        + (" (upsert: replaced)" if job.upsert and overlap else ""),
        {"overlap": overlap, "imported_rows": imported.num_rows},
    )


def _live_pks(
    storage: Storage, every: list[SegmentInfo], mine: set[int], partition: int, pk: str, before: int
) -> pa.Array | None:
    """The pks live in `partition` outside the job's segments, deletes older than the
    import applied (the rows they removed are not "already there")."""
    others = [s for s in every if s.id not in mine and s.partition_id == partition and readable(s)]
    existing = read_files(storage, [b.path for s in others for b in s.binlogs[0].logs], [pk, "timestamp"])
    if existing is None:
        return None
    deletes = read_deletes(storage, delete_paths(every, partition))
    deletes = deletes.filter(pc.less(deletes["timestamp"], before)) if deletes.num_rows else deletes
    return apply_deletes_to(existing, deletes, pk)[pk].combine_chunks()
