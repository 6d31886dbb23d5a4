"""`vchan demo`: the whole pipeline on generated data, on the embedded stack.

Starts etcd (and Spark), creates a collection with 4 vchannels (VarChar primary keys, a
JSON field, and a partition key `tenant` over 4 hidden partitions), produces rows and
deletes into the log, flushes, syncs every vchannel into binlogs under a channel
lease, waits for the flush state, checks the binlogs against what was produced, runs
the segment lifecycle, builds an IVF_FLAT index and searches it for rows' own vectors,
prints what it did, and stops the stack (unless --keep). Its last lines say what it stopped
and what is still running (`ending`), as found after the stop.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from vchan_assets.config import Settings
from vchan_assets.datacoord.leases import grant_channel_lease
from vchan_assets.datacoord.recovery import channel_checkpoint, channel_segments
from vchan_assets.datanode.sync import SyncTask
from vchan_assets.fields import varchar_pks
from vchan_assets.meta.allocator import IdAllocator
from vchan_assets.meta.embedded import pid_alive
from vchan_assets.meta.store import MetaStore
from vchan_assets.model import CollectionInfo, CollectionSchema, SegmentLevel, SegmentState
from vchan_assets.stack import Stack
from vchan_assets.storage import Storage
from vchan_assets.wal.producer import Producer, generate_rows

# Milvus' usual schema: document ids as VarChar keys, a JSON metadata field, and a tenant
# whose value picks each row's hidden partition (a search or read for one tenant opens one).
SCHEMA = CollectionSchema.build(
    "id",
    {"embedding": 128},
    {"tenant": "varchar(16)", "age": "int8", "score": "float", "label": "varchar(32)", "meta": "json?"},
    pk_type="varchar(36)",
    partition_key="tenant",
)
DEMO_PARTITIONS = 4


def demo_keys(numbers: Sequence[int] | range) -> list[str]:
    """The primary keys of the demo's rows `numbers` (the rows `generate_rows` makes)."""
    return varchar_pks(SCHEMA.primary, np.asarray(numbers, dtype=np.int64)).to_pylist()


class DemoCheckError(AssertionError):
    """The binlogs do not hold exactly what was produced."""


@dataclass(frozen=True)
class DemoOptions:
    rows: int = 200_000
    batch: int = 20_000
    deletes: int = 2_000
    channels: int = 4
    keep: bool = False


def run_demo(settings: Settings, options: DemoOptions, console: Console | None = None) -> int:
    console = console or Console(width=120)
    started = time.monotonic()
    stack = Stack.open(settings, detach=options.keep)
    try:
        health = stack.health(with_spark=True)
        console.print(
            f"[bold]embedded stack healthy[/]: etcd {health['etcd_version']} at {health['etcd_endpoints']}, "
            f"Spark {health['spark_version']} ({health['spark_master']}), storage {health['storage']}"
        )
        producer = Producer(stack)
        info = create_demo_collection(producer, options.channels, console)
        name = info.name

        deleted, flush_ts, inserted_ts = produce_demo_data(producer, name, options, console)
        console.print(f"produced {options.rows:,} rows and {len(deleted):,} deletes; flush at ts {flush_ts}")
        check_read(
            stack,
            info,
            "a fresh read, before any sync (every row still in the log)",
            options.rows,
            deleted,
            console,
        )

        ids = IdAllocator(stack.store)
        for vchannel in info.vchannels:
            lease = grant_channel_lease(stack.store, ids, vchannel, node_id=1)
            result = SyncTask(stack, info, vchannel, lease).run()
            console.print(
                f"synced {vchannel}: offsets ({result.start.offset}, {result.end.offset}], {result.rows:,} rows, "
                f"{result.deletes:,} deletes, {result.files} files in {result.seconds:.1f}s"
            )
        if not producer.wait_flushed(name, flush_ts, timeout=60):
            raise DemoCheckError(f"flush at ts {flush_ts} did not complete")
        check_binlogs(stack.store, stack.storage, info, options.rows, deleted)
        console.print(_summary(stack, info))
        check_read(
            stack,
            info,
            f"a read at ts {inserted_ts} (after the inserts, before the deletes)",
            options.rows,
            [],
            console,
            as_of=inserted_ts,
        )
        _lifecycle(stack, settings, info, options.rows, deleted, console)
        console.print(_summary(stack, info))
        console.print(
            f"[bold green]demo finished in {time.monotonic() - started:.0f}s[/]: every row is in exactly one "
            "flushed binlog and every delete in a delta log"
        )
        return 0
    finally:
        processes = etcd_process(stack)
        stack.close(stop_etcd=not options.keep)
        for line in ending(processes, stopping=not options.keep):
            console.print(line)


@dataclass(frozen=True)
class DemoProcess:
    """A process the demo ran with, as its last lines name it."""

    name: str
    pid: int


def etcd_process(stack: Stack) -> list[DemoProcess]:
    """The embedded etcd the demo runs on (none on a cluster's etcd)."""
    if stack.etcd is None or stack.etcd.pid is None:
        return []
    name = f"etcd at {stack.etcd.endpoint}" + ("" if stack.etcd.owned else ", which ran before the demo")
    return [DemoProcess(name, stack.etcd.pid)]


def ending(processes: Sequence[DemoProcess], stopping: bool, settle: float = 10.0) -> list[str]:
    """The demo's last lines: which of `processes` stopped and which still run, looked up
    (not assumed) once those being stopped had `settle` seconds to exit, and how to stop
    what is left."""
    deadline = time.monotonic() + settle
    while stopping and any(pid_alive(p.pid) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    running = [p for p in processes if pid_alive(p.pid)]
    stopped = [p for p in processes if p not in running]
    lines = []
    if stopped:
        lines += ["stopped:", *(f"  {p.name} (pid {p.pid})" for p in stopped)]
    if running:
        lines += ["still running:", *(f"  {p.name} (pid {p.pid})" for p in running)]
        lines.append("stop them with `vchan down`")
    elif processes:
        lines.append("nothing the demo ran is left running")
    return lines


def create_demo_collection(producer: Producer, channels: int, console: Console) -> CollectionInfo:
    """A new collection of `SCHEMA` on `channels` vchannels, named on the console."""
    name = f"demo_{uuid.uuid4().hex[:6]}"
    info = producer.create_collection(name, SCHEMA, num_channels=channels, num_partitions=DEMO_PARTITIONS)
    console.print(
        f"collection [bold]{name}[/] (id {info.id}) with vchannels {', '.join(info.vchannels)}; "
        f"primary key {SCHEMA.primary.name!r} {SCHEMA.primary.type_name}, partition key 'tenant' over "
        f"{len(info.partitions)} hidden partitions"
    )
    return info


def produce_demo_data(
    producer: Producer, name: str, options: DemoOptions, console: Console
) -> tuple[list[str], int, int]:
    """Insert the demo's rows (with a progress bar), delete some, flush; returns the
    deleted pks, the flush timestamp and the timestamp of the last insert (before the
    deletes)."""
    inserted_ts = 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("producing rows", total=options.rows)
        for start in range(0, options.rows, options.batch):
            n = min(options.batch, options.rows - start)
            appended = producer.insert(name, generate_rows(SCHEMA, n, start_pk=start, seed=start))
            inserted_ts = max([inserted_ts, *(a.timestamp for a in appended.values())])
            progress.advance(task, n)
    step = max(1, options.rows // max(options.deletes, 1))
    deleted = demo_keys(range(0, options.rows, step))[: options.deletes]
    producer.delete(name, deleted)  # in every partition, as Milvus deletes without one
    return deleted, producer.flush(name), inserted_ts


def check_binlogs(
    store: MetaStore, storage: Storage, info: CollectionInfo, rows: int, deleted: list[str]
) -> None:
    """Read the binlogs back with plain pyarrow: produced pks exactly once, deletes once.

    Under Dagster the sort sensor runs as soon as a segment is flushed, so the check may
    come after it: the sorted segment names the one it replaced (now Dropped) in
    `compaction_from` and holds its rows less the deleted ones (the sort applies the
    deletes it finds). Then a produced pk may be missing only if it was deleted. L0
    segments count whatever their state. A delete without a partition is one in each
    partition (as Milvus logs it), so each deleted pk is in the delta logs once per partition."""
    read = storage.read_parquet
    pk = info.schema.primary.name
    pks: Counter[str] = Counter()
    deletes: list[str] = []
    replaced: set[int] = set()
    for vchannel in info.vchannels:
        segments = [d.model for d in channel_segments(store, info.id, vchannel)]
        replaced |= {old for s in segments if s.state is SegmentState.FLUSHED for old in s.compaction_from}
        for seg in segments:
            if seg.level is SegmentLevel.L0:
                for log in seg.deltalogs:
                    deletes += read(log.path, columns=["pk"])["pk"].to_pylist()
                continue
            if seg.state is SegmentState.DROPPED and seg.id in replaced:
                continue
            if seg.state is not SegmentState.FLUSHED:
                raise DemoCheckError(f"segment {seg.id} is {seg.state.value} after the flush")
            for log in seg.binlogs[0].logs:
                pks.update(read(log.path, columns=[pk])[pk].to_pylist())
    produced = set(demo_keys(range(rows)))
    missing = produced - set(pks)
    if replaced:
        missing -= set(deleted)  # applied by a sort
    if missing or max(pks.values()) != 1 or len(pks) > rows or not set(pks) <= produced:
        raise DemoCheckError(f"binlogs hold {sum(pks.values())} rows ({len(pks)} distinct), expected {rows}")
    if Counter(deletes) != Counter({pk: len(info.partitions) for pk in deleted}):
        expected = len(deleted) * len(info.partitions)
        raise DemoCheckError(
            f"delta logs hold {len(deletes)} deletes, expected {expected} ({len(deleted)} in each of "
            f"{len(info.partitions)} partitions)"
        )


def _lifecycle(
    stack: Stack, settings: Settings, info: CollectionInfo, rows: int, deleted: list[str], console: Console
) -> None:
    """The segment lifecycle on the demo's segments: one DataCoord step (sort/mix/L0
    compaction on Spark), then a GC pass with a short drop tolerance, checked through
    the catalog: every live row once, every delete applied."""
    from vchan_assets.lifecycle.gc import GarbageCollector
    from vchan_assets.lifecycle.step import lifecycle_step

    for _ in range(2):  # the second step finds the new segments' and L0 deletes' work done
        report = lifecycle_step(stack, collect=False)
        for o in report.outcomes:
            console.print(
                f"compaction plan {o.plan_id}: {o.state.value} {o.reason} -> segments {list(o.outputs)}"
            )
    time.sleep(1.0)
    gc = GarbageCollector(
        replace(stack, settings=replace(settings, gc_drop_tolerance=0.5, time_travel=0.5))
    ).run()
    console.print(
        f"garbage collection: {len(gc.dropped_segments)} dropped segments removed ({len(gc.segment_files)} files, "
        f"{gc.bytes / 1e6:.1f} MB), {len(gc.orphans)} orphans, {len(gc.wal_files)} log files"
    )
    check_lifecycle(stack, settings, info, rows, deleted, console)
    check_index_and_search(stack, info, deleted, console)


def check_read(
    stack: Stack,
    info: CollectionInfo,
    what: str,
    rows: int,
    deleted: list[str],
    console: Console,
    as_of: int | None = None,
) -> None:
    """Through the catalog, at `as_of` (None: now): the demo's rows, each once, less `deleted`."""
    from vchan_assets.catalog import Catalog

    pks = Catalog(stack).read_collection(info.name, with_vectors=False, as_of=as_of)[info.schema.primary.name]
    expected = set(demo_keys(range(rows))) - set(deleted)
    if len(pks) != len(expected) or set(pks) != expected:
        raise DemoCheckError(f"{what}: the catalog reads {len(pks)} rows, expected {len(expected)}")
    console.print(f"{what}: {len(pks):,} rows, each once")


def check_lifecycle(
    stack: Stack, settings: Settings, info: CollectionInfo, rows: int, deleted: list[str], console: Console
) -> None:
    """Through the catalog after compaction and GC: every live row once, every delete applied."""
    from vchan_assets.catalog import Catalog

    table = Catalog(stack).read_collection(info.name, with_vectors=False)
    pks = table[info.schema.primary.name]
    expected = set(demo_keys(range(rows))) - set(deleted)
    if len(pks) != len(expected) or set(pks) != expected:
        raise DemoCheckError(
            f"after the lifecycle the catalog reads {len(pks)} rows, expected {len(expected)}"
        )
    console.print(f"after the lifecycle: {len(pks):,} live rows, each once, every delete applied")


def _summary(stack: Stack, info: CollectionInfo) -> Table:
    table = Table(title=f"collection {info.name}")
    for column in ("vchannel", "lease holder", "checkpoint", "segments", "rows", "deletes", "binlog MB"):
        table.add_column(column, justify="right" if column not in ("vchannel",) else "left")
    for vchannel in info.vchannels:
        segs = [d.model for d in channel_segments(stack.store, info.id, vchannel)]
        cp = channel_checkpoint(stack.store, vchannel)
        lease = stack.store.read_lease(vchannel)
        size = sum(b.size_bytes for s in segs for b in (*s.binlog_files, *s.deltalogs, *s.statslogs))
        states = Counter(f"{s.level.value} {s.state.value}" for s in segs)
        table.add_row(
            vchannel,
            f"node {lease.node_id}" if lease else "-",
            str(cp.model.offset) if cp else "-",
            ", ".join(f"{n} {k}" for k, n in sorted(states.items())),
            f"{sum(s.num_rows for s in segs if s.level is not SegmentLevel.L0):,}",
            f"{sum(s.num_rows for s in segs if s.level is SegmentLevel.L0):,}",
            f"{size / 1e6:.1f}",
        )
    return table


DEMO_QUERIES = 5


def check_index_and_search(stack: Stack, info: CollectionInfo, deleted: list[str], console: Console) -> None:
    """An IVF_FLAT index on the demo's vector field, built on every sorted segment (in this
    process), then a search for the vectors of a few live rows: each must find its own row
    first, at distance 0; and a search within one tenant (one hidden partition opened)
    returns only that tenant's rows."""
    from vchan_assets.catalog import Catalog
    from vchan_assets.indexes.meta import create_index
    from vchan_assets.indexes.step import IndexBuilder
    from vchan_assets.storage.rows import float_vectors

    field = info.schema.vector_fields[0]
    create_index(stack.store, info, field.name, "IVF_FLAT", "L2", {"nlist": 64})
    started = time.monotonic()
    report = IndexBuilder(stack, "local").run(collection_id=info.id)
    if report.failed:
        raise DemoCheckError(f"index builds failed: {report.failed}")
    console.print(
        f"index IVF_FLAT nlist=64 on {field.name!r}: {len(report.finished)} segment builds, "
        f"{report.rows:,} rows indexed in {time.monotonic() - started:.1f}s"
    )
    catalog = Catalog(stack)
    gone = set(deleted)
    pks = [pk for pk in demo_keys(range(1, 10 * DEMO_QUERIES)) if pk not in gone][:DEMO_QUERIES]
    rows = catalog.read_collection(info.name, as_arrow=True, pks=pks)
    pk_name = info.schema.primary.name
    wanted = rows[pk_name].to_pylist()
    vectors = float_vectors(rows[field.name], field.dim or 0)
    started = time.monotonic()
    hits = catalog.search(info.name, vectors, k=3, output_fields=["age"])
    seconds = time.monotonic() - started
    first = hits.groupby("query").head(1).sort_values("query")
    found = first[pk_name].tolist()
    if found != wanted or (first["distance"] > 1e-3).any():
        raise DemoCheckError(f"a search for rows {wanted}' own vectors found {found} first")
    console.print(
        f"search (k=3) for the vectors of rows {wanted}: each found itself first, at distance 0 "
        f"({seconds:.2f}s through the index and the query view)"
    )
    tenant = rows["tenant"][0].as_py()
    within = catalog.search(
        info.name, vectors[:1], k=10, filter=f"tenant == {tenant!r}", output_fields=["tenant", "meta"]
    )
    if within.empty or set(within["tenant"]) != {tenant}:
        raise DemoCheckError(
            f"a search within tenant {tenant!r} returned tenants {sorted(set(within['tenant']))}"
        )
    console.print(
        f"search within tenant {tenant!r} (k=10, one of {len(info.partitions)} hidden partitions opened): "
        f"{len(within)} hits, all of that tenant"
    )
