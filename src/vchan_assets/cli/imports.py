"""`vchan import`: bulk import of files into flushed segments, and its jobs."""

from __future__ import annotations

import argparse

from vchan_assets.cli.base import UsageError, command, engine_arg, opened
from vchan_assets.config import Settings
from vchan_assets.datacoord.collections import DEFAULT_PARTITION

# --- bulk import ------------------------------------------------------------------------


def _import_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", metavar="FILE_OR_DIR", help="input files or directories")
    parser.add_argument("--collection", help="collection to import into")
    parser.add_argument("--partition", default=DEFAULT_PARTITION, help="partition (default: _default)")
    parser.add_argument(
        "--format", choices=("parquet", "json", "csv"), default="parquet", help="input format"
    )
    parser.add_argument("--job-id", type=int, help="job id (submitting the same id again imports once)")
    parser.add_argument(
        "--upsert", action="store_true", help="replace the rows whose pk is already in the collection"
    )
    parser.add_argument(
        "--drop-unknown-columns", action="store_true", help="ignore columns the schema does not have"
    )
    parser.add_argument("--wait", action="store_true", help="run the job here and show its progress")
    engine_arg(parser, "import tasks")
    parser.add_argument("--status", type=int, metavar="JOB", help="show one job")
    parser.add_argument("--list", action="store_true", help="list every import job")


@command("import", "bulk-import Parquet, JSON-lines or CSV files into flushed segments", _import_args)
def import_files(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets import imports
    from vchan_assets.imports.progress import ProgressPrinter, describe

    try:
        with opened(settings) as stack:
            store = stack.store
            if args.list:
                for job in imports.jobs(store=store, settings=settings):
                    print(describe(job))
                return 0
            if args.status is not None:
                job = imports.status(args.status, store=store, settings=settings)
                print(describe(job, verbose=True))
                return 0 if job.state is not imports.ImportState.FAILED else 1
            if not args.collection or not args.files:
                raise UsageError("give --collection and at least one FILE_OR_DIR (or --status JOB / --list)")
            job_id = imports.submit(
                args.collection, args.files, partition=args.partition, format=args.format, job_id=args.job_id,
                upsert=args.upsert,
                drop_unknown_columns=args.drop_unknown_columns, store=store, settings=settings,
            )  # fmt: skip
            print(f"import job {job_id} submitted", flush=True)
            if not args.wait:
                return 0
            with ProgressPrinter() as progress:
                job = imports.run(
                    job_id, engine=args.engine, on_progress=progress, store=store, settings=settings
                )
            print(describe(job, verbose=True))
            return 0 if job.state is imports.ImportState.COMPLETED else 1
    except imports.ImportInputError as exc:  # a path that does not exist
        raise UsageError(str(exc)) from None
