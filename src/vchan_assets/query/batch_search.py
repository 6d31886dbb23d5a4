"""Batch search in Spark: a DataFrame of query vectors -> the k nearest rows of each.

    search_dataframe(system, info, queries, SearchOptions(k=10, ...), id_column="query",
                     vector_column="vector", by="segment") -> Spark DataFrame
                     (<id_column>, <pk>, distance, *output_fields)

(`Catalog.search_dataframe(collection, queries, ...)`.) The same search as `query.search`
(the query view at T, deletes applied, indexed segments through their index and the rest
exactly, the same options (`query.search_options.SearchOptions`), request checks and
errors) with the segments searched by Spark tasks:

- the driver resolves T, pins the read, lists the segments served at T with their builds
  and deletes (`plan_search`) and collects the query vectors (the query DataFrame's
  `id_column` and `vector_column`: an integer and an array of floats per row, or the bytes
  of a binary vector);
- `by="segment"` (the default): one Spark task per segment, each loading that segment's
  index once and searching every query; `by="query"`: one task per slice of the queries
  (as many as Spark's default parallelism), each searching every segment. A task keeps
  the k best per query of what it searched;
- the driver searches the log tail exactly (small: what the DataNodes have not flushed),
  merges the tasks' candidates into the k best per query (`query.search.finish`: the same
  merge, so the same hits as `Catalog.search`), reports the segments searched exactly
  (warnings, a rebuild queued for an unusable file), and returns them as a DataFrame.

Why by segment: a segment's index is loaded (read and deserialized) by one task only,
and each task's work is one faiss batch search of all queries; by query, every task
loads every index and reads every segment's columns, so that work is repeated once per
task. On 2 shared cores the two tie (BENCHMARKS.md, "Batch search in Spark": both run 2
tasks at a time, and by segment's extra tasks cost what it saves); by segment is what
scales with executors and segments.

The queries and the candidates (tasks x queries x k rows) pass through the driver, which
bounds a batch to what it holds in memory (100,000 queries of 128 floats: 51 MB).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vchan_assets.datacoord.read_pins import pin_or_lost, shared_pin
from vchan_assets.indexes.engine import OURS
from vchan_assets.model import CollectionInfo, IndexEngine
from vchan_assets.query.asof import replanned, resolve_as_of
from vchan_assets.query.search import (
    Fallback,
    SearchError,
    SearchRequest,
    SegmentPart,
    finish,
    merge_hits,
    planned,
    search_segment,
)
from vchan_assets.query.search_options import SearchOptions
from vchan_assets.storage import Storage
from vchan_assets.system import System

Distribution = Literal["segment", "query"]
RESULT_SCHEMA = pa.schema([("task", pa.int64()), ("result", pa.binary())])


@dataclass(frozen=True)
class SearchTask:
    """One Spark task: these segments, for the queries [first, last)."""

    parts: tuple[SegmentPart, ...]
    first: int
    last: int


@dataclass(frozen=True)
class TaskInputs:
    """What every task shares (shipped once in the job's closure)."""

    storage: Storage
    request: SearchRequest
    engine: IndexEngine
    tasks: tuple[SearchTask, ...]


def run_task(inputs: TaskInputs, number: int) -> tuple[pa.Table, list[Fallback]]:
    """One task's k best per query of its segments (`query` as positions in the whole
    batch) and the segments it searched exactly although indexed."""
    task = inputs.tasks[number]
    request = replace(inputs.request, queries=inputs.request.queries[task.first : task.last])
    hits: list[pa.Table] = []
    fallbacks: list[Fallback] = []
    for part in task.parts:
        found, fallback = search_segment(inputs.storage, request, part, inputs.engine)
        hits += found
        fallbacks += [fallback] if fallback is not None else []
    best = merge_hits(request, hits)
    shifted = pc.add(best["query"], pa.scalar(task.first, pa.int64()))
    return best.set_column(0, "query", shifted), fallbacks


def tasks_arrow(inputs: list[TaskInputs], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: each input row is a task number; each yields one pickled row.
    (`inputs` holds the one shared TaskInputs once per task: pickled once.)"""
    for batch in batches:
        for number in batch.column(0).to_pylist():
            result = pickle.dumps(run_task(inputs[int(number)], int(number)))
            yield pa.RecordBatch.from_pylist([{"task": number, "result": result}], schema=RESULT_SCHEMA)


def plan_tasks(parts: list[SegmentPart], queries: int, by: Distribution, slices: int) -> list[SearchTask]:
    if by == "segment":
        return [SearchTask((part,), 0, queries) for part in parts]
    if by != "query":
        raise ValueError(f"by must be 'segment' or 'query', got {by!r}")
    if not parts:
        return []
    bounds = np.linspace(0, queries, min(slices, queries) + 1).astype(int)
    return [
        SearchTask(tuple(parts), int(a), int(b)) for a, b in zip(bounds, bounds[1:], strict=False) if b > a
    ]


def collect_queries(
    info: CollectionInfo, queries: Any, id_column: str, vector_column: str
) -> tuple[np.ndarray, Any]:
    """(ids, vectors) of a Spark DataFrame of queries."""
    missing = [c for c in (id_column, vector_column) if c not in queries.columns]
    if missing:
        raise SearchError(
            info.name,
            f"the query DataFrame has no column {missing[0]!r} (columns: {', '.join(queries.columns)})",
        )
    table = queries.select(id_column, vector_column).toArrow()
    ids = table[id_column].to_numpy(zero_copy_only=False)
    if not np.issubdtype(ids.dtype, np.integer):
        raise SearchError(
            info.name, f"query ids ({id_column!r}) must be integers, got {table.schema.field(id_column).type}"
        )
    vectors = table[vector_column].to_pylist()
    return ids.astype(np.int64), vectors


def search_dataframe(
    system: System, info: CollectionInfo, queries: Any, options: SearchOptions | None = None, **batch: Any
) -> Any:
    """The k nearest rows of each query of the `queries` DataFrame (module docstring), as
    a DataFrame on the same Spark session: `id_column`, the primary key, `distance` and
    the output fields. `batch`: `search_table`'s keywords after `options`."""
    return queries.sparkSession.createDataFrame(search_table(system, info, queries, options, **batch))


def search_table(
    system: System,
    info: CollectionInfo,
    queries: Any,
    options: SearchOptions | None = None,
    id_column: str = "query",
    vector_column: str = "vector",
    by: Distribution = "segment",
    engine: IndexEngine = OURS,
    timeout: float = 900.0,
) -> pa.Table:
    """`search_dataframe`'s hits as an Arrow table (on the driver), with the segments
    searched exactly in its metadata (`query.search.exact_segments`). `options`: as
    `query.search.search` takes them (default: `SearchOptions()`)."""
    from vchan_assets.spark.session import run_arrow_tasks

    if by not in ("segment", "query"):
        raise SearchError(info.name, f"by must be 'segment' or 'query', got {by!r}")
    ids, vectors = collect_queries(info, queries, id_column, vector_column)
    spark = queries.sparkSession
    options = options or SearchOptions()
    ts = resolve_as_of(system.store, system.settings, options.as_of)

    with shared_pin(system.store, system.settings, info.id, ts) as pin, pin_or_lost(system.store, pin):
        # (the log tails are read while planning)
        request, plan = replanned(lambda: planned(system, info, vectors, options, ts))
        slices = max(1, int(spark.conf.get("spark.default.parallelism", "0") or 0) or _cores(spark))
        tasks = plan_tasks(plan.parts, request.queries.shape[0], by, slices)
        inputs = TaskInputs(system.storage, request, engine, tuple(tasks))
        hits = plan.tail_hits(request)
        fallbacks: list[Fallback] = []
        if tasks:
            description = (
                f"search {info.name}: {request.queries.shape[0]} queries, {len(tasks)} tasks by {by}"
            )
            rows = run_arrow_tasks(
                spark, tasks_arrow, [inputs] * len(tasks), RESULT_SCHEMA, description, timeout
            )
            for row in rows:
                found, fell_back = pickle.loads(row["result"])
                hits.append(found)
                fallbacks += fell_back
        result = finish(system, info, request, hits, fallbacks, plan.builds)
    named = pa.array(ids[result["query"].to_numpy()], pa.int64()) if len(result) else pa.array([], pa.int64())
    return result.set_column(0, id_column, named)


def _cores(spark: Any) -> int:
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect has no SparkContext
        return 2
