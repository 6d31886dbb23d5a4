"""Pre-import (Milvus' PreImport task): every file checked before anything is written.

Per file: it exists and is not empty, it is readable in the job's format, its columns fit
the collection schema (`files.plan_columns`), the primary key has no nulls, vectors have
the right dimension and no nulls; rows and bytes are counted. Across the job: no primary
key twice. Parquet files are read only where their metadata cannot answer: the primary
key, and vector columns whose dimension or nulls the footer does not fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vchan_assets.fields import arrow_type
from vchan_assets.imports.files import (
    FileSource,
    ImportInputError,
    convert_column,
    file_schema,
    parquet_file,
    plan_columns,
    read_batches,
)
from vchan_assets.imports.jobs import ImportFile, ImportFormat
from vchan_assets.model import CollectionSchema


def pre_import(
    source: FileSource,
    schema: CollectionSchema,
    paths: Sequence[str],
    fmt: ImportFormat,
    drop_unknown: bool = False,
) -> tuple[ImportFile, ...]:
    """The files with their counts; ImportInputError (file, column, reason) on the first
    that does not fit."""
    files = []
    pks = []
    for path in paths:
        counted, keys = check_file(source, schema, path, fmt, drop_unknown)
        files.append(counted)
        pks.append(keys)
    check_unique(schema.primary.name, list(paths), pks)
    return tuple(files)


def check_file(
    source: FileSource, schema: CollectionSchema, path: str, fmt: ImportFormat, drop_unknown: bool
) -> tuple[ImportFile, np.ndarray]:
    size = source.size(path)
    if size == 0:
        raise ImportInputError(path, "is empty")
    plan = plan_columns(schema, file_schema(source, path, fmt), path, drop_unknown)
    row_groups = 0
    if fmt is ImportFormat.PARQUET:
        pf = parquet_file(source, path)
        row_groups = pf.num_row_groups
        columns = [schema.primary.name, *_vectors_to_read(schema, pf, plan.read)]
    else:
        columns = list(plan.read)  # text formats: every value is parsed anyway
    rows = 0
    keys = []
    for batch in read_batches(source, path, fmt, columns=columns):
        for name in columns:
            convert_column(schema.field(name), batch.column(name), path, rows)
        pk = batch.column(schema.primary.name).cast(arrow_type(schema.primary))
        keys.append(pk.to_numpy(zero_copy_only=False))
        rows += batch.num_rows
    if rows == 0:
        raise ImportInputError(path, "has no rows")
    return ImportFile(path, rows, size, row_groups), np.concatenate(keys)


def _vectors_to_read(schema: CollectionSchema, pf: pq.ParquetFile, present: Sequence[str]) -> list[str]:
    """Vector columns the footer cannot vouch for: variable-length lists (their dimension
    is per row), and fixed-size ones without null counts in the statistics."""
    out = []
    arrow = pf.schema_arrow
    for f in schema.vector_fields:
        if f.name not in present:
            continue
        kind = arrow.field(f.name).type
        fixed = pa.types.is_fixed_size_list(kind) or pa.types.is_fixed_size_binary(kind)
        if not fixed or not _footer_says_no_nulls(pf, f.name):
            out.append(f.name)
    return out


def _footer_says_no_nulls(pf: pq.ParquetFile, column: str) -> bool:
    meta = pf.metadata
    indices = [i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == column]
    for rg in range(meta.num_row_groups):
        for i in indices:
            stats = meta.row_group(rg).column(i).statistics
            if stats is None or not stats.has_null_count or stats.null_count:
                return False
    return True


def check_unique(pk: str, paths: list[str], keys: list[np.ndarray]) -> None:
    """No primary key twice in the job; the error names the files that hold it."""
    ordered = np.concatenate(keys) if keys else np.array([], np.int64)
    if len(ordered) < 2:
        return
    ordered.sort()  # in place: 8 bytes a row is the whole memory cost of the check
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if not len(repeated):
        return
    value = repeated[0].item() if isinstance(repeated[0], np.generic) else repeated[0]
    holders = [p for p, k in zip(paths, keys, strict=True) if (k == value).any()]
    where = "twice in it" if len(holders) == 1 else f"also in {holders[1]}"
    raise ImportInputError(holders[0], f"primary key {value} appears more than once in the job ({where})", pk)
