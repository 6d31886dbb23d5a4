"""Parquet writer settings of the binlogs, one at a time: what each costs and saves.

    .venv/bin/python -m bench.parquet_settings [--rows 500000] [--repeat 5]

The sync writes each column group of a segment as its own Parquet file (docs/architecture.md):
the vector group (row_id + a 128-d float32 vector as fixed_size_binary(512)) and the scalar
group (row_id, timestamp, pk and the scalars). For each group this writes the same table
with the settings the sync uses and with one setting changed, interleaved, into files that
are fsynced (as the sync's are), and reads each file back with pyarrow. Reports the median
write and read seconds, MB/s of the table's in-memory size, and the file size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vchan_assets.datanode.binlog_writer import column_groups, parquet_options
from vchan_assets.model import CollectionSchema
from vchan_assets.wal.producer import generate_rows

SCHEMA = CollectionSchema.build("pk", {"vec": 128}, {"n": "int64", "f": "float", "s": "string"})

# One change at a time from what the sync writes.
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "vector": {
        "as synced": {},
        "dictionary on": {"use_dictionary": True},
        "statistics on": {"write_statistics": True},
        "snappy": {"compression": "snappy"},
        "zstd": {"compression": "zstd"},
        "page 8 MB": {"data_page_size": 8 << 20},
        "row groups of 64k rows": {"row_group_size": 65_536},
    },
    "scalar": {
        "as synced": {},
        "dictionary on every column": {"use_dictionary": True},
        "dictionary off": {"use_dictionary": False},
        "statistics off": {"write_statistics": False},
        "no compression": {"compression": "none"},
        "zstd": {"compression": "zstd"},
    },
}


def group_tables(rows: int) -> dict[str, pa.Table]:
    table = generate_rows(SCHEMA, rows, start_pk=0, seed=1)
    table = table.append_column("offset", pa.array(range(rows), pa.int64()))
    table = table.append_column("timestamp", pa.array(range(rows), pa.int64()))
    out = {}
    for group, columns in column_groups(SCHEMA):
        name = "scalar" if group == 0 else "vector"
        out[name] = table.select(columns).rename_columns(["row_id", *columns[1:]])
    return out


def write_fsynced(table: pa.Table, path: Path, options: dict[str, Any]) -> float:
    started = time.perf_counter()
    with open(path, "wb") as sink:
        pq.write_table(table, sink, **options)
        sink.flush()
        os.fsync(sink.fileno())
    return time.perf_counter() - started


def read_seconds(path: Path) -> float:
    started = time.perf_counter()
    pq.read_table(path)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tables = group_tables(args.rows)
    with tempfile.TemporaryDirectory(prefix="vchan-parquet-") as work:
        for group, variants in VARIANTS.items():
            table = tables[group]
            mb = table.nbytes / 2**20
            base = parquet_options(table, group == "vector")
            times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
            for _ in range(args.repeat):
                for name, change in variants.items():
                    path = Path(work) / f"{group}.parquet"
                    written = write_fsynced(table, path, {**base, **change})
                    times[name].append((written, read_seconds(path), path.stat().st_size))
                    path.unlink()
            print(f"\n{group} group, {args.rows:,} rows, {mb:.0f} MB in memory; sync writes {base}")
            synced = statistics.median(t[0] for t in times["as synced"])
            for name, runs in times.items():
                write = statistics.median(t[0] for t in runs)
                read = statistics.median(t[1] for t in runs)
                size = runs[0][2] / 2**20
                print(
                    f"  {name:24s} write {write:6.3f}s ({mb / write:6.0f} MB/s, x{write / synced:4.2f} of as synced)"
                    f"  read {read:6.3f}s  file {size:7.1f} MB"
                )


if __name__ == "__main__":
    main()
