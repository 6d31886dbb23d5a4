"""Binlog and index file layout (docs/architecture.md, "Binlogs"); keys are relative to the
storage root. The binlog keys are declared in `model`, whose segment records derive their
paths from them."""

from __future__ import annotations

from vchan_assets.model import DELTA_LOG, INSERT_LOG, STATS_LOG, delta_log_key, insert_log_key, stats_log_key

__all__ = [
    "BINLOG_ROOTS",
    "DELTA_LOG",
    "INDEX_FILES",
    "INSERT_LOG",
    "STATS_LOG",
    "delta_log_key",
    "index_file_key",
    "insert_log_key",
    "segment_of",
    "stats_log_key",
]

BINLOG_ROOTS = (INSERT_LOG, DELTA_LOG, STATS_LOG)
INDEX_FILES = "index_files"


def index_file_key(build_id: int, version: int, name: str) -> str:
    """A file of one build of a segment index: each retry (version) writes its own."""
    return f"{INDEX_FILES}/{build_id}/{version}/{name}"


def segment_of(key: str) -> tuple[int, int, int] | None:
    """(collection, partition, segment) of a binlog key, or None for other keys."""
    parts = key.split("/")
    if len(parts) < 5 or parts[0] not in BINLOG_ROOTS:
        return None
    try:
        return int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
