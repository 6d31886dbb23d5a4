"""Binlog and index file layout (docs/architecture.md, "Binlogs"); keys are relative to the
storage root."""

from __future__ import annotations

INSERT_LOG = "insert_log"
DELTA_LOG = "delta_log"
STATS_LOG = "stats_log"
BINLOG_ROOTS = (INSERT_LOG, DELTA_LOG, STATS_LOG)
INDEX_FILES = "index_files"


def insert_log_key(collection_id: int, partition_id: int, segment_id: int, group: int, log_id: int) -> str:
    return f"{INSERT_LOG}/{collection_id}/{partition_id}/{segment_id}/{group}/{log_id}.parquet"


def delta_log_key(collection_id: int, partition_id: int, segment_id: int, log_id: int) -> str:
    return f"{DELTA_LOG}/{collection_id}/{partition_id}/{segment_id}/{log_id}.parquet"


def stats_log_key(collection_id: int, partition_id: int, segment_id: int, log_id: int) -> str:
    return f"{STATS_LOG}/{collection_id}/{partition_id}/{segment_id}/{log_id}"


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
