"""`vchan create-collection` and `vchan produce`: collections and their log."""

from __future__ import annotations

import argparse
import time

import numpy as np

from vchan_assets import fields
from vchan_assets.cli.base import SCALAR_TYPES, UsageError, _positive, command, names, open_producer, scalars
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import DEFAULT_PARTITION, CollectionExistsError
from vchan_assets.model import CollectionSchema, DataType
from vchan_assets.wal.producer import ChannelAppend, generate_rows

# --- create-collection ------------------------------------------------------------------


def _create_collection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", "--name", dest="collection", required=True, help="collection name")
    parser.add_argument("--dim", type=int, default=128, help="dimension of the vector field (default 128)")
    parser.add_argument("--vector", default="vector", help="name of the vector field (default: vector)")
    parser.add_argument(
        "--vector-type",
        choices=("float", "float16", "bfloat16", "binary", "sparse"),
        default="float",
        help="values of the vector field: float32 (default), float16 / bfloat16 (half the bytes), "
        "binary (--dim bits, a multiple of 8), or sparse (sparse_float_vector: no --dim)",
    )
    parser.add_argument(
        "--pk",
        default="id",
        help="the primary key as NAME or NAME:TYPE, TYPE int64 (the default) or varchar(N) (default: id)",
    )
    parser.add_argument(
        "--scalars",
        default="age:int64,label:string",
        help=f"scalar fields as name:type,... (types: {SCALAR_TYPES})",
    )
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help="keep the keys of inserted rows the schema lacks in the dynamic field $meta (JSON)",
    )
    parser.add_argument(
        "--partition-key",
        default=None,
        help="a scalar field (int64 or varchar) whose value's hash picks each row's hidden partition",
    )
    parser.add_argument(
        "--num-partitions",
        type=int,
        default=16,
        help="hidden partitions of a collection with --partition-key (default 16)",
    )
    parser.add_argument(
        "--ttl",
        type=int,
        default=0,
        help="collection.ttl.seconds: rows expire this many seconds after their insert (default 0: never)",
    )
    parser.add_argument("--shards", type=int, default=2, help="number of vchannels (default 2)")
    parser.add_argument("--partitions", default="", help="extra partitions besides _default: a,b,...")
    parser.add_argument("--if-not-exists", action="store_true", help="succeed if the collection exists")


def _vector_spec(kind: str, dim: int) -> int | str:
    """The vector field of `--vector-type` as `CollectionSchema.build` takes it."""
    if kind == "float":
        return dim
    return "sparse_float_vector" if kind == "sparse" else f"{kind}_vector({dim})"


@command("create-collection", "create a collection and its vchannels", _create_collection_args)
def create_collection(args: argparse.Namespace, settings: Settings) -> int:
    try:
        pk, _, pk_type = args.pk.partition(":")
        schema = CollectionSchema.build(
            pk,
            {args.vector: _vector_spec(args.vector_type, args.dim)},
            scalars(args.scalars),
            pk_type or "int64",
            dynamic=args.dynamic,
            partition_key=args.partition_key,
        )
    except ValueError as exc:  # a bad type name, field name or dimension
        raise UsageError(f"invalid schema: {exc}") from None
    with open_producer(settings) as producer:
        try:
            info = producer.create_collection(
                args.collection,
                schema,
                names(args.partitions),
                num_channels=args.shards,
                ttl_seconds=args.ttl,
                num_partitions=args.num_partitions,
            )
        except CollectionExistsError:
            if not args.if_not_exists:
                raise
            info = producer.collection(args.collection)
            print(f"collection {info.name} exists (id {info.id})")
            return 0
    print(f"created collection {info.name} (id {info.id})")
    print(f"  fields: {', '.join(f'{f.name}:{f.spec}' for f in info.schema.fields)}")
    print(f"  partitions: {', '.join(info.partition_names)}")
    print(f"  vchannels: {', '.join(info.vchannels)}")
    return 0


# --- produce ----------------------------------------------------------------------------


def _produce_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection to insert into")
    parser.add_argument("--rows", type=_positive, required=True, help="rows to insert")
    parser.add_argument(
        "--batch", type=_positive, default=10_000, help="rows per insert call (default 10000)"
    )
    parser.add_argument(
        "--deletes", type=int, default=0, help="delete this many of the inserted pks at the end"
    )
    parser.add_argument("--partition", default=DEFAULT_PARTITION, help="partition to insert into")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the generated data")
    parser.add_argument(
        "--start-pk",
        type=int,
        default=None,
        help="first primary key (default: fresh IDs, unique across runs)",
    )
    parser.add_argument("--flush", action="store_true", help="seal the collection's segments at the end")


@command("produce", "insert generated rows (and deletes) into a collection's log", _produce_args)
def produce(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if args.deletes < 0 or args.deletes > args.rows:
        raise UsageError(f"--deletes must be between 0 and --rows ({args.rows})")
    with open_producer(settings) as producer:
        info = producer.collection(args.collection)
        start_pk = producer.ids.alloc(args.rows) if args.start_pk is None else args.start_pk
        appended: dict[str, ChannelAppend] = {}
        segments: set[int] = set()
        started = time.monotonic()
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        with progress:
            task = progress.add_task(f"insert {info.name}", total=args.rows, rate="")
            done = 0
            while done < args.rows:
                n = min(args.batch, args.rows - done)
                rows = generate_rows(info.schema, n, start_pk + done, seed=args.seed + done)
                for vchannel, result in producer.insert(info.name, rows, args.partition).items():
                    appended[vchannel] = result
                    segments.update(s for s, _ in result.segments)
                done += n
                rate = done / max(time.monotonic() - started, 1e-9)
                progress.update(task, completed=done, rate=f"{rate:,.0f} rows/s")
            insert_seconds = time.monotonic() - started
            if args.deletes:
                rng = np.random.default_rng(args.seed)
                pks = start_pk + rng.choice(args.rows, size=args.deletes, replace=False)
                if info.schema.primary.dtype is DataType.VARCHAR:  # as generate_rows wrote them
                    pks = fields.varchar_pks(info.schema.primary, pks)
                task = progress.add_task("delete", total=args.deletes, rate="")
                for i in range(0, args.deletes, args.batch):
                    chunk = pks[i : i + args.batch]
                    appended.update(producer.delete(info.name, chunk))
                    progress.update(task, advance=len(chunk))
        flush_ts = producer.flush(info.name) if args.flush else None
    print(
        f"inserted {args.rows} rows (pk {start_pk}..{start_pk + args.rows - 1}) into {info.name} "
        f"in {insert_seconds:.2f}s ({args.rows / max(insert_seconds, 1e-9):,.0f} rows/s), "
        f"{len(segments)} segments; deleted {args.deletes}"
    )
    for vchannel in info.vchannels:
        if vchannel in appended:
            print(
                f"  {vchannel}: head offset {appended[vchannel].last_offset} ts {appended[vchannel].timestamp}"
            )
    if flush_ts is not None:
        print(f"flush_ts {flush_ts}")
    return 0
