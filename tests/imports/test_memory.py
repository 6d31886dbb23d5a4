"""An import task's memory does not grow with the rows of its file: it reads one row group
at a time and writes binlogs whenever its buffers pass their budget. Measured as the Arrow
memory pool's peak in a fresh process per file size (no timing involved)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vchan_assets.testing.import_files import rows, write_parquet

PROBE = """
import sys
import pyarrow as pa
from vchan_assets.imports.files import FileSource
from vchan_assets.imports.jobs import ImportFormat
from vchan_assets.imports.task import ImportSpec, ImportTask
from vchan_assets.model import CollectionSchema
from vchan_assets.storage import Storage

schema = CollectionSchema.build("pk", {"vec": 8}, {"n": "int64", "f": "float", "s": "string", "b": "bool"})
spec = ImportSpec(
    job_id=1, task=0, source=FileSource(), path=sys.argv[1], format=ImportFormat.PARQUET, row_groups=None,
    storage=Storage(sys.argv[2]), schema=schema, collection_id=1, partition_id=2, vchannels=("a", "b"),
    timestamp=1 << 40, row_id_base=0, segment_ids=tuple(range(10, 20)), log_id_base=100,
    log_id_count=10_000, max_rows=10_000_000, buffer_bytes=1 << 20,
)
written = ImportTask(spec).run()
print(sum(s.num_rows for s in written), pa.default_memory_pool().max_memory())
"""


def _peak(tmp: Path, n: int) -> int:
    path = write_parquet(tmp / f"in-{n}.parquet", rows(n), row_group_size=10_000)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, path, str(tmp / f"out-{n}")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    written, peak = map(int, done.stdout.split())
    assert written == n
    return peak


# Two child processes, each importing a file (400k rows for the larger): 10-25 s.
@pytest.mark.integration
def test_an_import_tasks_peak_memory_is_flat_in_the_rows_of_its_file(tmp_path: Path) -> None:
    small, large = _peak(tmp_path, 50_000), _peak(tmp_path, 400_000)

    assert large < 1.5 * small, f"peak Arrow memory {small >> 10} KiB at 50k rows, {large >> 10} KiB at 400k"
