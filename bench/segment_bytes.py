"""The bytes of one segment's value in etcd, and how much of them are binlog paths.

`python -m bench.segment_bytes`: a Flushed, sorted segment of a collection with a
primary key, two scalars and one vector field (two column groups: the scalars with the
system fields, the vector alone), with 1, 4 and 16 binlogs per column group, as many
deltalogs and one stats log per insert binlog. IDs are of a cluster that ran a while (the
allocator counts from 1). Prints the value as written now (paths the layout derives left
out) and as written with every path (what older versions wrote, still decoded). No
timing: bytes only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

from vchan_assets.meta.codec import SCHEMA_VERSION, encode
from vchan_assets.model import (
    Binlog,
    ColumnGroupBinlogs,
    MsgPosition,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    delta_log_key,
    insert_log_key,
    stats_log_key,
)

COLLECTION, PARTITION, SEGMENT = 4_211, 4_212, 1_186_734
GROUPS = ((0, (0, 1, 100, 102, 103)), (101, (101,)))  # (group, field IDs): scalars, vector
TS = 454_123_456_789_012_480
VCHANNEL = "by-dev-rootcoord-dml_3_4211v0"


def segment(logs_per_group: int) -> SegmentInfo:
    ids = (COLLECTION, PARTITION, SEGMENT)
    log_id = iter(range(9_871_200, 9_999_999))

    def binlog(path_of: Callable[[int], str], rows: int, size: int, n: int) -> Binlog:
        lid = next(log_id)
        return Binlog(lid, path_of(lid), rows, TS + n * 1_000_000, TS + (n + 1) * 1_000_000, size)

    rows = 8_192
    binlogs = tuple(
        ColumnGroupBinlogs(
            group,
            fields,
            tuple(
                binlog(partial(insert_log_key, *ids, group), rows, 2_451_288, n)
                for n in range(logs_per_group)
            ),
        )
        for group, fields in GROUPS
    )
    deltalogs = tuple(binlog(partial(delta_log_key, *ids), 37, 1_911, n) for n in range(logs_per_group))
    statslogs = tuple(binlog(partial(stats_log_key, *ids), rows, 65_601, n) for n in range(logs_per_group))
    return SegmentInfo(
        id=SEGMENT,
        collection_id=COLLECTION,
        partition_id=PARTITION,
        vchannel=VCHANNEL,
        state=SegmentState.FLUSHED,
        level=SegmentLevel.L1,
        num_rows=rows * logs_per_group,
        max_rows=1_048_576,
        binlogs=binlogs,
        deltalogs=deltalogs,
        statslogs=statslogs,
        start_position=MsgPosition(VCHANNEL, 18_211_337, TS),
        dml_position=MsgPosition(VCHANNEL, 18_214_009, TS + logs_per_group * 1_000_000),
        compaction_from=(1_186_011, 1_186_012),
        is_sorted=True,
        last_flush_ts=TS + logs_per_group * 1_000_000,
        created_at=1_764_300_000.125,
        last_insert_at=1_764_300_061.5,
        seal_ts=TS + logs_per_group * 1_000_000,
        flushed_at=1_764_300_062.25,
    )


def with_paths(seg: SegmentInfo) -> bytes:
    """The value as written before paths were derived: every binlog with its path."""
    body = {
        **seg.to_dict(),
        "binlogs": [g.to_dict() for g in seg.binlogs],
        "deltalogs": [b.to_dict() for b in seg.deltalogs],
        "statslogs": [b.to_dict() for b in seg.statslogs],
    }
    return json.dumps({"v": SCHEMA_VERSION, **body}, separators=(",", ":")).encode()


def main() -> None:
    print("| binlogs per group | files | with paths | of it paths | paths derived | saved |")
    print("|---|---|---|---|---|---|")
    for n in (1, 4, 16):
        seg = segment(n)
        files = [*seg.binlog_files, *seg.deltalogs, *seg.statslogs]
        before, after = with_paths(seg), encode(seg)
        paths = sum(len(json.dumps({"path": b.path}, separators=(",", ":"))) - 1 for b in files)
        print(
            f"| {n} | {len(files)} | {len(before):,} B | {paths:,} B ({paths / len(before):.0%}) "
            f"| {len(after):,} B | {1 - len(after) / len(before):.0%} |"
        )


if __name__ == "__main__":
    main()
