"""Vector indexes and search: `vchan create-index`, `drop-index`, `describe-index`, `index`,
`search`."""

from __future__ import annotations

import argparse
import json
import sys

from vchan_assets.cli.base import UsageError, _positive, command, engine_arg, names, opened, opened_collection
from vchan_assets.config import Settings
from vchan_assets.model import CollectionInfo

INDEX_TYPES = (
    "FLAT",
    "IVF_FLAT",
    "IVF_PQ",
    "HNSW",
    "BIN_FLAT",
    "BIN_IVF_FLAT",
    "SPARSE_INVERTED_INDEX",
    "SPARSE_WAND",
)
METRICS = ("L2", "IP", "COSINE", "HAMMING", "JACCARD")


def key_values(items: list[str] | None, flag: str) -> dict[str, int | float]:
    """`name=value` items (integers; a value with a point or exponent a float: the sparse
    indexes' drop ratios), as `--param` gives them."""
    out: dict[str, int | float] = {}
    for item in items or []:
        name, sep, raw = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            out[name.strip()] = float(raw) if any(c in raw for c in ".eE") else int(raw)
        except ValueError:
            raise UsageError(f"{flag} {item!r}: expected name=integer (or a float), e.g. nlist=128") from None
    return out


# --- create-index -----------------------------------------------------------------------


def _default_metric(info: CollectionInfo, field: str) -> str:
    """L2, or HAMMING for a binary vector field (an unknown field: create_index names it)."""
    from vchan_assets.indexes.params import default_metric

    found = next((f for f in info.schema.vector_fields if f.name == field), None)
    return "L2" if found is None else default_metric(found).value


def _create_index_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection name")
    parser.add_argument("--field", required=True, help="the vector field to index")
    parser.add_argument("--type", required=True, type=str.upper, choices=INDEX_TYPES, help="index type")
    parser.add_argument(
        "--metric",
        default=None,
        type=str.upper,
        choices=METRICS,
        help="distance metric (default L2; HAMMING for a binary vector field)",
    )
    parser.add_argument(
        "--param",
        action="append",
        metavar="NAME=VALUE",
        help="a build parameter, repeatable: nlist (IVF), m and nbits (IVF_PQ), M and efConstruction (HNSW)",
    )
    parser.add_argument("--name", default=None, help="index name (default: the field's name)")
    parser.add_argument("--wait", action="store_true", help="build the segments' indexes here and wait")
    engine_arg(parser, "the builds")


@command("create-index", "create an index on a vector field and its segment builds", _create_index_args)
def create_index(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.indexes.meta import create_index as create
    from vchan_assets.indexes.meta import describe
    from vchan_assets.indexes.step import IndexBuilder
    from vchan_assets.model import SegmentIndexState

    params = key_values(args.param, "--param")
    with opened_collection(settings, args.collection) as (stack, info):
        metric = args.metric or _default_metric(info, args.field)
        index, created, builds = create(stack.store, info, args.field, args.type, metric, params, args.name)
        verb = "created" if created else "exists:"
        print(f"{verb} index {describe(index)} (id {index.index_id}) on {info.name}")
        to_build = [b.build_id for b in builds if b.state is SegmentIndexState.UNISSUED]
        done = len(builds) - len(to_build)
        print(f"  {len(builds)} new segment builds: {len(to_build)} to build, {done} with nothing to build")
        if not args.wait:
            return 0
        report = IndexBuilder(stack, args.engine).run(collection_id=info.id)
        for build_id, reason in report.failed:
            print(f"  build {build_id} failed: {reason}")
        print(
            f"  built {len(report.finished)} segments ({report.rows} rows, {report.seconds:.2f}s), "
            f"failed {len(report.failed)}"
        )
        return 1 if report.failed else 0


# --- drop-index -------------------------------------------------------------------------


def _drop_index_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection name")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", help="the index's name")
    which.add_argument("--field", help="the indexed vector field")


@command(
    "drop-index",
    "drop an index (no new builds start; garbage collection removes its files)",
    _drop_index_args,
)
def drop_index(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.indexes.meta import describe
    from vchan_assets.indexes.meta import drop_index as drop

    with opened_collection(settings, args.collection) as (stack, info):
        index = drop(stack.store, info, name=args.name, field=args.field)
    print(f"dropped index {describe(index)} (id {index.index_id}) of {info.name}")
    return 0


# --- index --retry / --upgrade -----------------------------------------------------------


def _index_args(parser: argparse.ArgumentParser) -> None:
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--retry",
        action="store_true",
        help="re-queue failed index builds (their attempts reset; the DataCoord runs them)",
    )
    action.add_argument(
        "--upgrade",
        action="store_true",
        help="queue rebuilds of the segment indexes of an older engine version than builds write now",
    )
    parser.add_argument("--collection", help="only this collection's (default: every collection's)")


@command(
    "index",
    "manage index builds: --retry re-queues the failed ones, --upgrade rebuilds older engine versions",
    _index_args,
)
def index(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.datacoord.collections import CollectionRegistry
    from vchan_assets.indexes.tasks import retry_failed_builds, upgrade_builds

    where = f" of {args.collection}" if args.collection else ""
    with opened(settings) as stack:
        collection_id = (
            CollectionRegistry(stack.store).get_by_name(args.collection).id if args.collection else None
        )
        if args.upgrade:
            target, again = upgrade_builds(stack.store, collection_id)
            segments = sorted({b.segment_id for b in again})
            print(
                f"queued {len(again)} index rebuilds{where} to engine version {target}: segments {segments}"
            )
            return 0
        builds, tasks = retry_failed_builds(stack.store, collection_id)
    print(f"re-queued {builds} failed index builds{where} ({tasks} failed tasks back in the queue)")
    return 0


# --- describe-index ---------------------------------------------------------------------


def _describe_index_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection name")
    parser.add_argument("--json", action="store_true", help="print JSON")


@command("describe-index", "show a collection's indexes and how far their builds are", _describe_index_args)
def describe_index(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.indexes.meta import collection_progress, describe, progress_row

    with opened_collection(settings, args.collection) as (stack, info):
        progress = collection_progress(stack.store, info)
    if args.json:
        print(json.dumps([progress_row(info, p) for p in progress], indent=2))
        return 0
    if not progress:
        print(f"{info.name}: no indexes")
    for p in progress:
        share = f" ({100 * p.indexed_rows / p.total_rows:.0f}%)" if p.total_rows else ""
        print(f"index {describe(p.index)} (id {p.index.index_id})")
        print(f"  indexed rows {p.indexed_rows} / {p.total_rows}{share}")
        print(
            f"  segments {p.segments}: {p.finished} finished, {p.pending} pending, {p.in_progress} in progress, "
            f"{len(p.failed)} failed, {p.waiting} waiting (not sorted yet, or no build yet)"
        )
        for segment, reason in p.failed:
            print(f"  failed: segment {segment}: {reason}")
    return 0


# --- search -----------------------------------------------------------------------------


def _search_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection name")
    queries = parser.add_mutually_exclusive_group(required=True)
    queries.add_argument(
        "--vector",
        action="append",
        metavar="X,Y,...",
        help="a query vector (comma-separated; a binary vector's bytes), repeatable",
    )
    queries.add_argument(
        "--random",
        type=_positive,
        metavar="N",
        help="N random query vectors (uniform in [0, 1); random bytes for binary vectors)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    parser.add_argument("-k", "--top-k", dest="k", type=int, default=10, help="hits per query (default 10)")
    parser.add_argument("--field", default=None, help="the vector field (needed when there are several)")
    parser.add_argument(
        "--metric",
        default=None,
        help="L2, IP or COSINE; HAMMING or JACCARD for binary vectors (default: the index's; "
        "L2 or HAMMING without one)",
    )
    parser.add_argument(
        "--param",
        action="append",
        metavar="NAME=VALUE",
        help="a search parameter: nprobe (IVF, BIN_IVF_FLAT), ef (HNSW)",
    )
    parser.add_argument("--filter", default=None, help='a condition on the scalar fields, e.g. "age > 30"')
    parser.add_argument("--as-of", default=None, help="search as of this time (ISO-8601 or hybrid timestamp)")
    parser.add_argument("--output-fields", default="", help="scalar fields to show with each hit: a,b,...")
    parser.add_argument("--json", action="store_true", help="print the hits as JSON lines")


@command(
    "search", "the nearest rows of query vectors (through the indexes where they are built)", _search_args
)
def search(args: argparse.Namespace, settings: Settings) -> int:
    import numpy as np

    from vchan_assets.indexes.engine import reader_session
    from vchan_assets.query.search import SearchError, exact_segments
    from vchan_assets.query.search import search as run_search
    from vchan_assets.query.search_options import search_options

    params = key_values(args.param, "--param")
    try:
        options = search_options(
            args.collection, k=args.k, field=args.field, metric=args.metric, filter=args.filter,
            as_of=args.as_of, params=params, output_fields=names(args.output_fields),
        )  # fmt: skip
    except SearchError as exc:
        raise UsageError(str(exc)) from None
    with opened_collection(settings, args.collection) as (stack, info):
        name = args.field or info.schema.vector_fields[0].name
        field = next((f for f in info.schema.vector_fields if f.name == name), None)
        binary = field is not None and field.is_binary_vector
        kind = np.uint8 if binary else np.float32  # binary vectors: their packed bytes
        if args.vector:
            try:
                values = np.array([[float(x) for x in v.split(",")] for v in args.vector])
            except ValueError:
                raise UsageError("--vector: expected comma-separated numbers, e.g. 0.1,0.2,0.3") from None
            if binary and not ((values >= 0) & (values <= 255) & (values == np.floor(values))).all():
                raise UsageError(
                    "--vector: a binary vector is its bytes, integers in [0, 255], e.g. 0,255,17"
                )
            vectors = values.astype(kind)
        elif binary:
            assert field is not None
            vectors = np.random.default_rng(args.seed).integers(
                0, 256, (args.random, field.vector_bytes), dtype=np.uint8
            )
        else:
            dim = field.dim if field is not None and field.dim else 1
            vectors = np.random.default_rng(args.seed).random((args.random, dim), dtype=np.float32)
        try:
            with reader_session(stack.store, settings.session_ttl):
                hits = run_search(stack, info, vectors, options)
        except SearchError as exc:
            raise UsageError(str(exc)) from None
    for fallback in exact_segments(hits):
        print(f"segment {fallback['segment']} searched exactly: {fallback['reason']}", file=sys.stderr)
    frame = hits.to_pandas()
    if args.json:
        for record in frame.to_dict("records"):
            print(json.dumps(record, default=str))
    else:
        print(frame.to_string(index=False) if len(frame) else "no hits")
    return 0
