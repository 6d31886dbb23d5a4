"""Invariant checks of the segment lifecycle (what the Dagster lifecycle asset checks
report after every step), usable without Dagster:

- `check_rows_conserved`: for each completed compaction, rows in = rows out + the rows of
  its inputs that the deletes it applied remove (recomputed from the input files and the
  delta logs the plan recorded, kept until GC);
- `check_unique_live_pks`: no primary key visible (not deleted) in two live segments of a vchannel;
- `check_live_files_exist`: every file named by the meta of a live segment exists;
- `storage_figures`: storage bytes and file counts (binlogs, log), for metadata over time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import pyarrow as pa

from vchan_assets.datacoord.collections import CollectionRegistry
from vchan_assets.datanode.checks import CheckOutcome, files_exist_outcome
from vchan_assets.lifecycle.plans import CompactionPlan, CompactionType
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import SegmentInfo, SegmentLevel, SegmentState
from vchan_assets.storage import Storage
from vchan_assets.storage.layout import BINLOG_ROOTS
from vchan_assets.storage.rows import apply_deletes_to, delete_paths, read_deletes, read_files, unexpired


def _segments(store: MetaStore) -> list[SegmentInfo]:
    """Every segment, the Dropped ones GC has not deleted yet included (they are counted)."""
    found = SegmentMeta(store).list(include_dropped=True)
    return [d.model for d in found]


def _live_l1(segments: Sequence[SegmentInfo]) -> list[SegmentInfo]:
    return [s for s in segments if s.state is not SegmentState.DROPPED and s.level is not SegmentLevel.L0]


def check_rows_conserved(store: MetaStore, storage: Storage, plans: Sequence[CompactionPlan]) -> CheckOutcome:
    segments = {s.id: s for s in _segments(store)}
    bad = []
    gone = 0
    plans = [p for p in plans if p.type is not CompactionType.L0]  # L0: no rows in or out
    for p in plans:
        counted = _recount(store, storage, p, segments)
        if counted is None:
            gone += 1
        elif counted != (p.rows_in, p.rows_out):
            bad.append(f"plan {p.plan_id}: in {p.rows_in}/{counted[0]}, out {p.rows_out}/{counted[1]}")
    return CheckOutcome(
        not bad,
        f"{len(plans)} compactions: rows in = rows out + deleted and expired rows"
        + (f" ({gone} no longer checkable: files garbage-collected)" if gone else "")
        + (f"; wrong: {bad[:3]}" if bad else ""),
        {"compactions": len(plans), "wrong": len(bad), "garbage_collected": gone},
    )


def _recount(
    store: MetaStore, storage: Storage, p: CompactionPlan, segments: dict[int, SegmentInfo]
) -> tuple[int, int] | None:
    """(rows in, rows left after the deletes the plan applied and the rows a TTL expired),
    from the input files; None once GC removed what it would read."""
    inputs = [segments[i] for i in p.input_ids if i in segments]
    # The deletes the compaction applied (recorded at commit), not those a sync added since;
    # for plans written before that record: the live ones of the partition and the inputs'.
    paths = (
        set(p.deletes_applied)
        if p.deletes_applied is not None
        else {
            *delete_paths(list(segments.values()), p.partition_id),
            *(b.path for s in inputs for b in s.deltalogs),
        }
    )
    if len(inputs) != len(p.inputs) or not all(storage.exists(path) for path in paths):
        return None
    pk = CollectionRegistry(store).get(p.collection_id, include_dropped=True).schema.primary.name
    rows = read_files(
        storage, [b.path for s in inputs for g in s.binlogs[:1] for b in g.logs], [pk, "timestamp"]
    )
    rows = rows if rows is not None else pa.table({pk: pa.array([], pa.int64())})
    kept = unexpired(rows, p.expire_before)  # the rows a TTL had expired when it was planned
    return rows.num_rows, apply_deletes_to(kept, read_deletes(storage, sorted(paths)), pk).num_rows


def check_unique_live_pks(store: MetaStore, storage: Storage) -> CheckOutcome:
    """No pk visible in two live segments of a vchannel: deleted rows (a delete newer than
    the row, in its partition) do not count, so a pk deleted then inserted again is one row."""
    segments = _segments(store)
    by_channel: dict[tuple[int, str], list[SegmentInfo]] = defaultdict(list)
    for s in _live_l1(segments):
        by_channel[(s.collection_id, s.vchannel)].append(s)
    duplicates = 0
    rows = 0
    catalog = CollectionRegistry(store)
    for (collection_id, _), segs in by_channel.items():
        pk = catalog.get(collection_id, include_dropped=True).schema.primary.name
        counts: Counter[object] = Counter()
        for partition in {s.partition_id for s in segs}:
            paths = [
                b.path for s in segs if s.partition_id == partition for g in s.binlogs[:1] for b in g.logs
            ]
            found = read_files(storage, paths, [pk, "timestamp"])
            if found is None:
                continue
            visible = apply_deletes_to(found, read_deletes(storage, delete_paths(segments, partition)), pk)
            counts.update(visible[pk].to_pylist())
            rows += visible.num_rows
        duplicates += sum(c - 1 for c in counts.values() if c > 1)
    return CheckOutcome(
        duplicates == 0,
        f"{rows} visible rows in live segments of {len(by_channel)} vchannels, "
        f"{duplicates} duplicated primary keys",
        {"rows": rows, "duplicates": duplicates},
    )


def check_live_files_exist(store: MetaStore, storage: Storage) -> CheckOutcome:
    paths = [p for s in _segments(store) if s.state is not SegmentState.DROPPED for p in s.file_paths]
    return files_exist_outcome(storage, paths, "files named by live segment meta", "files")


def storage_figures(store: MetaStore, storage: Storage) -> dict[str, int]:
    segments = _segments(store)
    binlogs = [i for root in BINLOG_ROOTS for i in storage.list_files(root + "/")]
    wal = storage.list_files("wal/")
    return {
        "live_segments": len([s for s in segments if s.state is not SegmentState.DROPPED]),
        "dropped_segments": len([s for s in segments if s.state is SegmentState.DROPPED]),
        "binlog_files": len(binlogs),
        "binlog_bytes": sum(int(i.size or 0) for i in binlogs),
        "wal_files": len(wal),
        "wal_bytes": sum(int(i.size or 0) for i in wal),
    }
