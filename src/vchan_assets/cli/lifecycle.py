"""The segment lifecycle by hand: `vchan compact`, `vchan gc`, and `vchan quarantine` (a
damaged log file moved aside, its loss recorded: `wal.quarantine`)."""

from __future__ import annotations

import argparse
import time

from vchan_assets.cli.base import command, engine_arg, opened, opened_collection
from vchan_assets.config import Settings
from vchan_assets.model import SegmentIndex, SegmentInfo
from vchan_assets.system import System

# --- segment lifecycle ------------------------------------------------------------------


def _compact_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collection", required=True, help="collection name")
    parser.add_argument(
        "--type",
        choices=("sort", "l0", "mix"),
        default="mix",
        help="sort by pk, move L0 deletes into the segments they hit (l0), or merge (mix)",
    )
    parser.add_argument("--wait", action="store_true", help="run the plans here and wait for each to finish")
    engine_arg(parser, "tasks")


@command("compact", "plan (and with --wait run) a manual compaction of a collection", _compact_args)
def compact(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.lifecycle.compaction import CompactionExecutor, CompactionTrigger
    from vchan_assets.lifecycle.plans import CompactionType, PlanState

    with opened_collection(settings, args.collection) as (stack, info):
        kind = CompactionType(args.type)
        plans = CompactionTrigger(stack).trigger(info, kind, manual=True)
        for p in plans:
            print(f"plan {p.plan_id}: {p.type} of segments {list(p.input_ids)} -> {p.state}", flush=True)
        if not plans:
            print(f"{args.collection}: nothing to compact ({kind})")
        if not args.wait or not plans:
            return 0
        executor = CompactionExecutor(stack, engine=args.engine)
        outcomes = executor.run_pending([p.plan_id for p in plans])
        for i, o in enumerate(outcomes, 1):
            detail = f"-> segments {list(o.outputs)}" if o.state is PlanState.COMPLETED else o.reason
            print(f"[{i}/{len(outcomes)}] plan {o.plan_id}: {o.state} {detail}", flush=True)
        return 0 if all(o.state is PlanState.COMPLETED for o in outcomes) else 1


def _gc_args(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--once", action="store_true", help="one pass now (the default)")
    what.add_argument("--pause", type=float, metavar="S", help="pause garbage collection for S seconds")
    what.add_argument("--resume", action="store_true", help="resume a paused garbage collection")
    parser.add_argument(
        "--dry-run", action="store_true", help="list what a pass would delete, delete nothing"
    )


@command("gc", "garbage-collect orphan binlogs, dropped segments, old log files and index files", _gc_args)
def gc(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.indexes.gc import collect_indexes
    from vchan_assets.lifecycle.gc import GarbageCollector

    with opened(settings) as stack:
        collector = GarbageCollector(stack, passes=[collect_indexes])
        if args.pause is not None:
            print(f"garbage collection paused for {args.pause:g}s")
            collector.pause(args.pause)
            return 0
        if args.resume:
            collector.resume()
            print("garbage collection resumed")
            return 0
        report = collector.run(dry_run=args.dry_run)
        if report.paused_until:
            print(f"garbage collection is paused ({report.paused_until - time.time():.0f}s left)")
            return 0
        verb = "would delete" if args.dry_run else "deleted"
        for key in [*report.orphans, *report.segment_files, *report.wal_files, *report.index_files]:
            print(f"{verb} {key}")
        print(
            f"gc: {verb} {len(report.orphans)} orphans, {len(report.dropped_segments)} dropped segments "
            f"({len(report.segment_files)} files), {len(report.wal_files)} log files, "
            f"{len(report.index_builds)} index builds ({len(report.index_files)} files), "
            f"{report.bytes / 1e6:.1f} MB"
        )
        return 0


# --- getting past damage ----------------------------------------------------------------


def _quarantine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--file", required=True, help="the damaged log file (its path, as the error named it)"
    )
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")


@command(
    "quarantine",
    "move a damaged log file or binlog aside and go on without it (the loss is recorded for good)",
    _quarantine_args,
)
def quarantine(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.indexes.tasks import rebuild_segment
    from vchan_assets.lifecycle.quarantine import DamagedBinlog, inspect_binlog, is_binlog, quarantine_binlog
    from vchan_assets.wal.quarantine import inspect_log_file, quarantine_log_file

    with opened(settings) as stack:
        binlog = is_binlog(stack, args.file)
        damaged = inspect_binlog(stack, args.file) if binlog else inspect_log_file(stack, args.file)
        print(damaged.describe())
        if not args.yes:
            answer = input("quarantine it? type yes to go on: ")
            if answer.strip().lower() != "yes":
                print("nothing was changed")
                return 1
        if isinstance(damaged, DamagedBinlog):
            reset: list[SegmentIndex] = []

            def rebuild(system: System, seg: SegmentInfo, reason: str) -> None:
                reset.extend(rebuild_segment(system, seg, reason))

            loss = quarantine_binlog(stack, damaged, then=[rebuild])
            lost = f"segment {loss.segment_id}: {loss.rows} rows"
            if reset:
                print(
                    f"index builds of segment {loss.segment_id} reset, to be built again over "
                    f"its rows now: {', '.join(str(b.build_id) for b in reset)}"
                )
        else:
            loss = quarantine_log_file(stack, damaged)
            lost = f"{loss.vchannel} offsets {loss.first_offset}..{loss.last_offset}"
    print(f"quarantined: kept at {loss.moved_to}; loss {loss.loss_id} recorded ({lost}); the rest goes on")
    return 0


# --- tasks ------------------------------------------------------------------------------


def _tasks_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--retry",
        action="store_true",
        help="re-queue the Failed tasks (their attempts reset; the DataCoord runs them)",
    )
    parser.add_argument("--kind", choices=("sort", "index"), help="only this kind's (default: both)")
    parser.add_argument("--collection", help="only this collection's (default: every collection's)")


@command(
    "tasks",
    "list the DataCoord's sort and index tasks (state, attempts, why the last one failed); "
    "--retry re-queues the Failed ones",
    _tasks_args,
)
def tasks(args: argparse.Namespace, settings: Settings) -> int:
    from vchan_assets.datacoord.collections import CollectionRegistry
    from vchan_assets.datacoord.tasks import list_tasks, retry_tasks
    from vchan_assets.indexes.tasks import retry_failed_builds

    where = f" of {args.collection}" if args.collection else ""
    with opened(settings) as stack:
        registry = CollectionRegistry(stack.store)
        collection_id = registry.get_by_name(args.collection).id if args.collection else None
        if args.retry:
            sorts = len(retry_tasks(stack.store, "sort", collection_id)) if args.kind != "index" else 0
            builds, indexes = (
                retry_failed_builds(stack.store, collection_id) if args.kind != "sort" else (0, 0)
            )
            print(
                f"re-queued {sorts} failed sort tasks and {indexes} failed index tasks{where}"
                f" ({builds} failed index builds back to Unissued)"
            )
            return 0
        found = [
            d.model
            for d in list_tasks(stack.store, args.kind)
            if collection_id in (None, d.model.collection_id)
        ]
    if not found:
        print(f"no tasks{where}")
    now = time.time()
    for t in sorted(found, key=lambda t: (t.kind, t.collection_id, t.segment_id)):
        when = f", next try in {t.not_before - now:.0f}s" if t.not_before > now else ""
        why = f": {t.reason}" if t.reason else ""
        print(
            f"{t.kind} of segment {t.segment_id} (collection {t.collection_id}): {t.state}, "
            f"attempts {t.attempts}{when}{why}"
        )
    return 0
