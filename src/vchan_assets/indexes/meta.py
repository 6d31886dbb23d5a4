"""Index meta in etcd (docs/indexes.md; Milvus' indexMeta): field indexes and segment builds.

- `meta/field-index/{collection}/{index}`: one `FieldIndex` per vector field. CreateIndex
  with the same name and definition again returns the existing one; any other definition
  for the field (or the name on another field) is an `IndexConflictError`; a bad type,
  metric or parameter, a field that is not a vector, a collection that does not exist are
  refused before anything is written. DropIndex marks it `deleted`: no new build starts.
- `meta/segment-index/{collection}/{partition}/{segment}/{build}`: one `SegmentIndex` per
  (segment, index), the build task and its outcome:

      Unissued --start--> InProgress --files written, then one txn--> Finished
                              |                                       (files, version)
                              +--> Failed (reason)

  Every change is a compare-and-swap on the version its writer read: of two builders that
  both try to start one build, one wins; a build whose record changed while it ran (it was
  started again) commits nothing, and its files are orphans. Segments that need no files
  (FLAT, fewer than 1,024 rows) are created Finished.

Creates are optimistic transactions over a range of keys (`MetaStore.txn_unchanged_since`):
an index is created only if no index of the collection was added since the creator listed
them, and a segment's build only if no build of that segment was added since, and its
index not dropped meanwhile, so concurrent creators never make two.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from vchan_assets.datacoord.collections import CollectionNotFoundError, validate_name
from vchan_assets.errors import DeclaredError
from vchan_assets.indexes.params import build_params, check_fits
from vchan_assets.meta.allocator import IdAllocator, now_ts
from vchan_assets.meta.errors import CasConflictError, MetaError
from vchan_assets.meta.retry import retry_on_conflict
from vchan_assets.meta.segments import SegmentMeta
from vchan_assets.meta.store import Decoded, MetaStore
from vchan_assets.model import (
    CollectionInfo,
    FieldIndex,
    IndexType,
    MetricType,
    SegmentIndex,
    SegmentIndexState,
    SegmentInfo,
    SegmentLevel,
    SegmentState,
    awaited_indexes,
    needs_build,
)

# Builds created in one transaction at most (etcd refuses more than 128 operations in one).
TASKS_PER_TXN = 60


class IndexMetaError(MetaError):
    """Base class of index meta errors."""


class InvalidIndexError(DeclaredError, IndexMetaError, ValueError):
    """CreateIndex refused: nothing was written."""

    collection: str
    field: str
    reason: str
    message = "cannot index {collection}.{field}: {reason}"


class IndexConflictError(DeclaredError, IndexMetaError):
    """Another index holds the field (one per vector field) or the name."""

    collection: str
    field: str
    existing: str
    message = (
        "cannot index {collection}.{field}: index {existing} exists with another definition "
        "(one index per vector field: drop it first)"
    )


class IndexNotFoundError(DeclaredError, IndexMetaError, LookupError):
    collection: str
    ref: str
    message = "collection {collection!r} has no index {ref}"


class CreatedIndex(NamedTuple):
    field_index: FieldIndex
    created: bool  # False: the same index existed
    builds: list[SegmentIndex]  # made now, one per sorted segment that had none


def describe(index: FieldIndex) -> str:
    """`name` on `field` (TYPE, METRIC, params), as messages show an index."""
    params = "".join(f", {p.name}={p.value}" for p in index.params)
    return f"{index.name!r} on {index.field!r} ({index.type}, {index.metric}{params})"


# --- field indexes --------------------------------------------------------------------------


def list_indexes(
    store: MetaStore, collection_id: int | None = None, include_deleted: bool = False
) -> list[Decoded[FieldIndex]]:
    """The indexes of a collection (of every collection if None), by id."""
    family = store.keys.field_index
    prefix = family.prefix if collection_id is None else family.under(collection_id)
    found, _ = store.list_models(prefix, FieldIndex, skip_malformed=True)
    return live_indexes(found, include_deleted)


def live_indexes(
    found: Iterable[Decoded[FieldIndex]], include_deleted: bool = False
) -> list[Decoded[FieldIndex]]:
    """The listed indexes not dropped (all of them with `include_deleted`)."""
    return [d for d in found if include_deleted or not d.model.deleted]


def _enum(kind: type[IndexType] | type[MetricType], raw: object, what: str) -> Any:
    try:
        return kind(str(raw).upper())
    except ValueError:
        raise ValueError(f"unknown {what} {raw!r}: one of {', '.join(m.value for m in kind)}") from None


def create_index(
    store: MetaStore,
    info: CollectionInfo,
    field: str,
    index_type: IndexType | str,
    metric: MetricType | str,
    params: Mapping[str, object] | None = None,
    name: str | None = None,
    ids: IdAllocator | None = None,
) -> CreatedIndex:
    """CreateIndex: an index on the vector field `field` (`created`), or the one already
    there with the same name and definition; then a build for every sorted segment of
    the collection that has none (`builds`: those made now)."""

    def invalid(reason: str) -> InvalidIndexError:
        return InvalidIndexError(info.name, field, reason)

    try:
        schema_field = info.schema.field(field)
    except KeyError:
        vectors = ", ".join(f.name for f in info.schema.vector_fields)
        raise invalid(f"no such field (vector fields: {vectors})") from None
    if not schema_field.is_vector:
        raise invalid(f"it is a {schema_field.dtype} field, not a vector field")
    try:
        kind: IndexType = _enum(IndexType, index_type, "index type")
        metric_type: MetricType = _enum(MetricType, metric, "metric")
        check_fits(schema_field, metric_type, kind)
        stored_params = build_params(kind, params or {}, schema_field.dim or 0)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    index_name = validate_name("index", name or field)
    ids = ids or IdAllocator(store)
    collection_key = store.keys.collection(info.id)

    def attempt() -> tuple[FieldIndex, bool]:
        found = store.get_model(collection_key, CollectionInfo)
        if found is None or found.model.dropped_at:
            raise CollectionNotFoundError(info.name)
        listed, revision = store.list_models(store.keys.field_index.under(info.id), FieldIndex)
        wanted = FieldIndex(
            index_id=0,
            collection_id=info.id,
            name=index_name,
            field_id=schema_field.field_id,
            field=field,
            type=kind,
            metric=metric_type,
            params=stored_params,
            created_at=time.time(),
        )
        for d in listed:
            existing = d.model
            if existing.deleted or (existing.field_id != wanted.field_id and existing.name != index_name):
                continue
            if existing.same_definition(wanted):
                return existing, False
            raise IndexConflictError(info.name, field, describe(existing))
        index = replace(wanted, index_id=ids.alloc())
        key = store.keys.field_index(info.id, index.index_id)
        prefix = store.keys.field_index.under(info.id)
        if store.txn_unchanged_since(revision, [prefix], {key: index}, {collection_key: found.kv.version}):
            return index, True
        raise CasConflictError(prefix, revision, -1)  # an index was added meanwhile: look again

    index, created = retry_on_conflict(f"create index on {info.name}.{field}", attempt)
    return CreatedIndex(index, created, create_missing_builds(store, info, [index], ids))


def find_index(
    store: MetaStore, info: CollectionInfo, name: str | None = None, field: str | None = None
) -> Decoded[FieldIndex]:
    """The live index called `name`, or on `field`."""
    if name is None and field is None:
        raise ValueError("find_index needs an index name or a field")
    for d in list_indexes(store, info.id):
        if d.model.name == name or d.model.field == field:
            return d
    raise IndexNotFoundError(info.name, f"named {name!r}" if name else f"on field {field!r}")


def drop_index(
    store: MetaStore, info: CollectionInfo, name: str | None = None, field: str | None = None
) -> FieldIndex:
    """Mark the index deleted (a soft delete: no build of it starts any more; garbage
    collection removes its builds and files). Returns it as it was."""

    def attempt() -> FieldIndex:
        found = find_index(store, info, name, field)
        dropped = replace(found.model, deleted=True, deleted_at=time.time())
        store.cas(found.kv.key, found.kv.version, dropped)
        return found.model

    return retry_on_conflict(f"drop index of {info.name}", attempt)


# --- segment builds -------------------------------------------------------------------------


def indexable(seg: SegmentInfo) -> bool:
    """A segment that gets builds: Flushed, sorted, not L0, with rows (a sort's output, a
    mix compaction's, or a sorted import's). Unsorted segments wait for their sort."""
    return (
        seg.state is SegmentState.FLUSHED
        and seg.level is not SegmentLevel.L0
        and seg.is_sorted
        and seg.num_rows > 0
    )


def list_builds(store: MetaStore, collection_id: int | None = None) -> list[Decoded[SegmentIndex]]:
    family = store.keys.segment_index
    prefix = family.prefix if collection_id is None else family.under(collection_id)
    found, _ = store.list_models(prefix, SegmentIndex, skip_malformed=True)
    return found


def build_key(store: MetaStore, b: SegmentIndex) -> str:
    return store.keys.segment_index(b.collection_id, b.partition_id, b.segment_id, b.build_id)


def create_builds(
    store: MetaStore, index: FieldIndex, segments: Iterable[SegmentInfo], ids: IdAllocator | None = None
) -> list[SegmentIndex]:
    """A build of `index` for each indexable segment that has none: Unissued, or Finished
    with no files when nothing is built (FLAT, small segments). Returns those created."""
    ids = ids or IdAllocator(store)
    candidates = sorted((s for s in segments if indexable(s)), key=lambda s: s.id)
    created: list[SegmentIndex] = []
    for start in range(0, len(candidates), TASKS_PER_TXN):
        batch = candidates[start : start + TASKS_PER_TXN]
        attempt = functools.partial(_create_batch, store, index, batch, ids)
        created += retry_on_conflict(f"create builds of index {index.index_id}", attempt)
    return created


def _create_batch(
    store: MetaStore, index: FieldIndex, segments: Sequence[SegmentInfo], ids: IdAllocator
) -> list[SegmentIndex]:
    index_key = store.keys.field_index(index.collection_id, index.index_id)
    current = store.get_model(index_key, FieldIndex)
    if current is None or current.model.deleted:
        return []  # dropped meanwhile
    listed, revision = store.list_models(store.keys.segment_index.under(index.collection_id), SegmentIndex)
    has = {d.model.segment_id for d in listed if d.model.index_id == index.index_id}
    todo = [s for s in segments if s.id not in has]
    if not todo:
        return []
    first = ids.alloc(len(todo))
    now = time.time()
    builds = []
    for i, seg in enumerate(todo):
        build = SegmentIndex(
            build_id=first + i,
            index_id=index.index_id,
            collection_id=seg.collection_id,
            partition_id=seg.partition_id,
            segment_id=seg.id,
            rows=seg.num_rows,
            created_at=now,
        )
        if not needs_build(index.type, seg.num_rows):
            build = replace(build, state=SegmentIndexState.FINISHED, finished_at=now)
        builds.append(build)
    prefixes = [store.keys.segment_index.under(s.collection_id, s.partition_id, s.id) for s in todo]
    puts = {build_key(store, b): b for b in builds}
    if store.txn_unchanged_since(revision, prefixes, puts, {index_key: current.kv.version}) is None:
        raise CasConflictError(index_key, current.kv.version, -1)  # a build or the index changed
    return builds


def create_missing_builds(
    store: MetaStore,
    info: CollectionInfo,
    indexes: Sequence[FieldIndex] | None = None,
    ids: IdAllocator | None = None,
) -> list[SegmentIndex]:
    """A build of each live index of the collection (or of `indexes`) for every indexable
    segment without one."""
    if indexes is None:
        indexes = [d.model for d in list_indexes(store, info.id)]
    if not indexes:
        return []
    found = SegmentMeta(store).list(info.id, skip_malformed=True)
    ids = ids or IdAllocator(store)
    return [b for index in indexes for b in create_builds(store, index, [d.model for d in found], ids)]


def node_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def start_build(store: MetaStore, build: Decoded[SegmentIndex], node: str) -> Decoded[SegmentIndex] | None:
    """Unissued (or Failed, to retry) -> InProgress with the next version; None if another
    builder changed it first."""
    b = build.model
    started = replace(
        b,
        state=SegmentIndexState.IN_PROGRESS,
        version=b.version + 1,
        node=node,
        fail_reason="",
        started_at=time.time(),
    )
    return _swap(store, build, started)


@dataclass(frozen=True)
class BuiltFiles:
    files: tuple[str, ...]
    serialized_size: int
    engine_version: str
    engine: int  # the index engine version written for (`indexes.engine`)


def finish_build(
    store: MetaStore, build: Decoded[SegmentIndex], built: BuiltFiles
) -> Decoded[SegmentIndex] | None:
    """InProgress -> Finished with its files (written before this, under its version);
    None if the record changed since the start, or its index was dropped meanwhile (the
    transaction compares the index's record too: a DropIndex during the build is never
    undone by its commit): the files are then orphans, for GC. When it is
    the last build a compaction output waits for (`model.awaited_indexes`), the same
    transaction stamps the output's `ready_ts`: from then on it replaces its inputs in the
    query view."""
    done = replace(
        build.model,
        state=SegmentIndexState.FINISHED,
        files=built.files,
        serialized_size=built.serialized_size,
        engine_version=built.engine_version,
        engine=built.engine,
        finished_at=time.time(),
    )
    b = build.model
    segment_key = store.keys.segment(b.collection_id, b.partition_id, b.segment_id)
    index_key = store.keys.field_index(b.collection_id, b.index_id)

    def attempt() -> Decoded[SegmentIndex] | None:
        index = store.get_model(index_key, FieldIndex)
        if index is None or index.model.deleted:
            return None  # dropped while it was built
        expect: dict[str, int] = {build.kv.key: build.kv.version, index_key: index.kv.version}
        puts: dict[str, Any] = {build.kv.key: done}
        seg = store.get_model(segment_key, SegmentInfo)
        if seg is not None and _all_built(store, seg.model, done):
            expect[segment_key] = seg.kv.version
            puts[segment_key] = replace(seg.model, ready_ts=now_ts(store))
        if store.txn(expect, puts) is None:
            current = store.get(build.kv.key)
            if current is None or current.version != build.kv.version:
                return None  # started again by another builder: this one's files are orphans
            raise CasConflictError(segment_key, expect.get(segment_key, 0), -1)  # segment or index changed
        return store.get_model(build.kv.key, SegmentIndex)

    return retry_on_conflict(f"finish index build {b.build_id}", attempt)


def _all_built(store: MetaStore, seg: SegmentInfo, done: SegmentIndex) -> bool:
    """`seg` waits for its indexes, and with `done` each has a Finished build of it."""
    if seg.ready_ts or seg.state is SegmentState.DROPPED:
        return False
    awaited = awaited_indexes(seg, [d.model for d in list_indexes(store, seg.collection_id)])
    if not awaited:
        return False
    prefix = store.keys.segment_index.under(seg.collection_id, seg.partition_id, seg.id)
    found, _ = store.list_models(prefix, SegmentIndex, skip_malformed=True)
    finished = {d.model.index_id for d in found if d.model.state is SegmentIndexState.FINISHED}
    finished.add(done.index_id)
    return all(i.index_id in finished for i in awaited)


def release_waiting_outputs(
    store: MetaStore, collection_id: int, timeout: float, active: Collection[int] = ()
) -> list[int]:
    """Stamp `ready_ts` on the collection's compaction outputs that wait for an index that
    will not come, so that reads never wedge on them: a build of an awaited index that is
    Failed and not being retried (its segment not in `active`, the scheduler's queued or
    running index tasks), or a wait longer than `timeout` seconds since the output was
    made. Also an output whose awaited builds are all Finished (stamped by the last one's
    commit; this catches an index dropped meanwhile). Returns the segments stamped."""
    indexes = [d.model for d in list_indexes(store, collection_id)]
    if not indexes:
        return []
    found = SegmentMeta(store).list(collection_id, skip_malformed=True)
    waiting = [
        d
        for d in found
        if not d.model.ready_ts
        and d.model.state is not SegmentState.DROPPED
        and awaited_indexes(d.model, indexes)
    ]
    if not waiting:
        return []
    builds = {(d.model.segment_id, d.model.index_id): d.model for d in list_builds(store, collection_id)}
    stamped = []
    now = time.time()
    for d in waiting:
        seg = d.model
        states = [builds.get((seg.id, i.index_id)) for i in awaited_indexes(seg, indexes)]
        finished = all(b is not None and b.state is SegmentIndexState.FINISHED for b in states)
        failed = seg.id not in active and any(
            b is not None and b.state is SegmentIndexState.FAILED for b in states
        )
        if not (finished or failed or now - seg.created_at > timeout):
            continue
        try:
            store.cas(d.kv.key, d.kv.version, replace(seg, ready_ts=now_ts(store)))
        except CasConflictError:
            continue  # changed meanwhile: the next call looks again
        stamped.append(seg.id)
    return stamped


def reissue_build(
    store: MetaStore, build: Decoded[SegmentIndex], reason: str = ""
) -> Decoded[SegmentIndex] | None:
    """Back to Unissued, to be built again under its next version (a Failed build retried,
    a Finished one rebuilt: its file unusable, or of an older engine version); None if it
    changed since it was read. The old version's files become GC's (superseded)."""
    changed = replace(build.model, state=SegmentIndexState.UNISSUED)
    if reason:
        changed = replace(changed, reissue_reason=reason)
    return _swap(store, build, changed)


def reset_segment_builds(store: MetaStore, seg: SegmentInfo, reason: str) -> list[SegmentIndex]:
    """`seg`'s rows changed under its builds (a damaged binlog quarantined: rows gone, and
    the positions of the others, which are the index's ids, moved): each build of a live
    index goes back to Unissued with `reason` and the segment's row count now, whatever its
    state. A Finished one's file indexes rows no longer there; an InProgress one's commit is
    refused (its record changed since its start); a Failed one (its damaged file unreadable)
    may build now. When the rows left need no files (`needs_build`), the build is Finished
    without files under a new version instead (the old files are GC's). Returns the builds
    as written."""
    indexes = {d.model.index_id: d.model for d in list_indexes(store, seg.collection_id)}
    prefix = store.keys.segment_index.under(seg.collection_id, seg.partition_id, seg.id)

    def reset(index: FieldIndex, build_key: str) -> SegmentIndex | None:
        found = store.get_model(build_key, SegmentIndex)
        if found is None:
            return None  # collected meanwhile
        b = found.model
        if needs_build(index.type, seg.num_rows):
            changed = replace(b, state=SegmentIndexState.UNISSUED, rows=seg.num_rows, fail_reason="")
        else:
            changed = replace(
                b,
                state=SegmentIndexState.FINISHED,
                rows=seg.num_rows,
                version=b.version + 1,
                files=(),
                serialized_size=0,
                fail_reason="",
                finished_at=time.time(),
            )
        changed = replace(changed, reissue_reason=reason)
        store.cas(build_key, found.kv.version, changed)  # a builder's start or commit: read again
        return changed

    written = []
    found, _ = store.list_models(prefix, SegmentIndex, skip_malformed=True)
    for d in found:
        index = indexes.get(d.model.index_id)
        if index is None:
            continue  # its index was dropped: GC's
        attempt = functools.partial(reset, index, d.kv.key)
        if (b := retry_on_conflict(f"reset index build {d.model.build_id}", attempt)) is not None:
            written.append(b)
    return written


def fail_build(store: MetaStore, build: Decoded[SegmentIndex], reason: str) -> Decoded[SegmentIndex] | None:
    failed = replace(build.model, state=SegmentIndexState.FAILED, fail_reason=reason, finished_at=time.time())
    return _swap(store, build, failed)


def _swap(
    store: MetaStore, build: Decoded[SegmentIndex], changed: SegmentIndex
) -> Decoded[SegmentIndex] | None:
    try:
        store.cas(build.kv.key, build.kv.version, changed)
    except CasConflictError:
        return None
    return store.get_model(build.kv.key, SegmentIndex)


# --- progress ---------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexProgress:
    """How far one index is built over the collection's Flushed segments (what
    `vchan describe-index` and `Catalog.indexes()` show)."""

    index: FieldIndex
    total_rows: int  # rows of the Flushed segments
    indexed_rows: int  # of those, rows in segments whose build finished
    segments: int
    finished: int
    pending: int  # builds Unissued
    in_progress: int
    failed: tuple[tuple[int, str], ...]  # (segment, reason)
    waiting: int  # Flushed segments without a build yet (not sorted yet, or not triggered)


def index_progress(
    index: FieldIndex, segments: Sequence[SegmentInfo], builds: Sequence[SegmentIndex]
) -> IndexProgress:
    """Progress of `index` over `segments` (the collection's) from its `builds`. An
    invisible compaction output is not counted: its inputs are still served."""
    flushed = [
        s
        for s in segments
        if s.state is SegmentState.FLUSHED
        and s.level is not SegmentLevel.L0
        and s.num_rows > 0
        and not (s.is_invisible and s.compaction_from)
    ]
    by_segment = {b.segment_id: b for b in builds if b.index_id == index.index_id}
    states = [by_segment.get(s.id) for s in flushed]
    finished = [
        s for s, b in zip(flushed, states, strict=True) if b and b.state is SegmentIndexState.FINISHED
    ]
    return IndexProgress(
        index=index,
        total_rows=sum(s.num_rows for s in flushed),
        indexed_rows=sum(s.num_rows for s in finished),
        segments=len(flushed),
        finished=len(finished),
        pending=sum(1 for b in states if b and b.state is SegmentIndexState.UNISSUED),
        in_progress=sum(1 for b in states if b and b.state is SegmentIndexState.IN_PROGRESS),
        failed=tuple(
            (b.segment_id, b.fail_reason) for b in states if b and b.state is SegmentIndexState.FAILED
        ),
        waiting=sum(1 for b in states if b is None),
    )


def collection_progress(store: MetaStore, info: CollectionInfo) -> list[IndexProgress]:
    """`index_progress` of each live index of the collection."""
    found = SegmentMeta(store).list(info.id, skip_malformed=True)
    segments = [d.model for d in found]
    builds = [d.model for d in list_builds(store, info.id)]
    return [index_progress(d.model, segments, builds) for d in list_indexes(store, info.id)]


def progress_row(info: CollectionInfo, p: IndexProgress) -> dict[str, Any]:
    """One index's progress as a flat row (the catalog's table, `describe-index --json`)."""
    i = p.index
    return {
        "collection": info.name,
        "index_id": i.index_id,
        "name": i.name,
        "field": i.field,
        "type": i.type.value,
        "metric": i.metric.value,
        "params": {q.name: q.value for q in i.params},
        "created_at": i.created_at,
        "indexed_rows": p.indexed_rows,
        "total_rows": p.total_rows,
        "segments": p.segments,
        "finished": p.finished,
        "pending": p.pending,
        "in_progress": p.in_progress,
        "failed": len(p.failed),
        "waiting": p.waiting,
        "fail_reasons": {str(seg): reason for seg, reason in p.failed},
    }
