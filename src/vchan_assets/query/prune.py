"""Filters on the primary key and the partition, pushed down to the segments.

A read that asks only for some pks (`Catalog.read_collection(name, where=[("pk", "=",
42)])`, `df.filter(df.pk.isin(1, 2))` on `format("vchan")`) need not open every segment:
each segment's stats logs hold the pk range and a bloom filter of its rows
(`datanode.stats.PkStats`). `PkFilter` is the conjunction of the conditions on the pk
(`=`, `in`, `<`, `<=`, `>`, `>=`, `between`); `prune` keeps the segments whose range
overlaps it and, for equality and `in`, whose bloom filter may hold one of the values
(false positives only: a kept segment may hold none, a pruned one holds none for sure).
Rows of the kept segments and of the log tail are then filtered exactly (`PkFilter.mask`;
on a segment sorted by pk, a binary search instead of a scan).

`where` is a list of `(column, op, value)` conditions, all of which must hold (as the
`filters` of `pandas.read_parquet`): the column is the primary key or `partition`
(partition names, `=` or `in`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from vchan_assets.datanode.stats import PkStats
from vchan_assets.errors import DeclaredError
from vchan_assets.fields import Pk, key_array
from vchan_assets.model import CollectionInfo, DataType, SegmentInfo
from vchan_assets.query.filters import key_partitions
from vchan_assets.storage import Storage
from vchan_assets.storage.cache import ReadCache

log = logging.getLogger(__name__)

PK_OPS = ("=", "==", "in", "<", "<=", ">", ">=", "between")
PARTITION_COLUMN = "partition"


class FilterError(DeclaredError, ValueError):
    """A `where` condition the reader cannot apply: the message names it."""

    condition: str
    detail: str
    message = "filter {condition}: {detail}"


@dataclass(frozen=True)
class PkFilter:
    """Rows whose pk lies in [low, high] (either bound open, or None: unbounded) and,
    when `values` is set, is one of them. The empty filter (`PkFilter()`) keeps every row.
    Keys are int64 or VarChar, as the collection's pk."""

    values: tuple[Pk, ...] | None = None
    low: Pk | None = None
    low_open: bool = False
    high: Pk | None = None
    high_open: bool = False

    @property
    def everything(self) -> bool:
        return self.values is None and self.low is None and self.high is None

    @property
    def empty(self) -> bool:
        """No pk can match (contradicting bounds, or no value within them)."""
        if self.values is not None:
            return not self.in_range(key_array(self.values)).any()
        if self.low is None or self.high is None:
            return False
        return self.low > self.high or (self.low == self.high and (self.low_open or self.high_open))  # type: ignore[operator]

    def and_(self, other: PkFilter) -> PkFilter:
        """Both filters at once."""
        values = self.values
        if other.values is not None:
            values = other.values if values is None else tuple(sorted(set(values) & set(other.values)))
        low, low_open = _tighter((self.low, self.low_open), (other.low, other.low_open), max)
        high, high_open = _tighter((self.high, self.high_open), (other.high, other.high_open), min)
        return PkFilter(values, low, low_open, high, high_open)

    def in_range(self, pks: np.ndarray) -> np.ndarray:
        keep = np.ones(len(pks), dtype=bool)
        if self.low is not None:
            keep &= pks > self.low if self.low_open else pks >= self.low
        if self.high is not None:
            keep &= pks < self.high if self.high_open else pks <= self.high
        return keep

    def may_hold(self, stats: PkStats) -> bool:
        """Whether a binlog with these stats may hold a matching pk (range, then bloom)."""
        if stats.entries == 0:
            return False
        if self.values is None:
            return not self.and_(PkFilter(low=stats.pk_min, high=stats.pk_max)).empty
        wanted = key_array(self.values)
        wanted = wanted[self.in_range(wanted)]
        return bool(len(wanted)) and bool(stats.might_contain(wanted).any())

    def mask(self, pks: pa.Array | pa.ChunkedArray) -> pa.Array:
        """Per row: its pk matches."""
        arr = key_array(
            pks.to_numpy() if isinstance(pks, pa.ChunkedArray) else pks.to_numpy(zero_copy_only=False)
        )
        keep = self.in_range(arr)
        if self.values is not None:
            keep &= np.isin(arr, key_array(self.values))
        return pa.array(keep)

    def rows(self, table: pa.Table, pk: str, is_sorted: bool = False) -> pa.Table:
        """The rows of `table` whose pk matches; of a table sorted by pk, a binary search for
        a range (no scan)."""
        if self.everything or table.num_rows == 0:
            return table
        if is_sorted and self.values is None:
            pks = key_array(table[pk].to_numpy())
            start = (
                0
                if self.low is None
                else np.searchsorted(pks, self.low, side="right" if self.low_open else "left")
            )
            stop = (
                len(pks)
                if self.high is None
                else np.searchsorted(pks, self.high, side="left" if self.high_open else "right")
            )
            return table.slice(int(start), max(0, int(stop - start)))
        return table.filter(self.mask(table[pk]))


def _tighter(a: tuple[Pk | None, bool], b: tuple[Pk | None, bool], pick: Any) -> tuple[Pk | None, bool]:
    """The tighter of two bounds (`pick`: max for lower bounds, min for upper); at equal
    values, the open one."""
    if a[0] is None:
        return b
    if b[0] is None or a[0] == b[0]:
        return (a[0], a[1] or b[1]) if b[0] is not None else a
    return a if pick(a[0], b[0]) == a[0] else b


@dataclass(frozen=True)
class Pushdown:
    """What a read keeps: pks (`PkFilter`) and partition ids (None: all)."""

    pk: PkFilter = PkFilter()  # noqa: RUF009 (frozen: a shared default is safe)
    partitions: frozenset[int] | None = None

    @property
    def everything(self) -> bool:
        return self.pk.everything and self.partitions is None

    def keeps_partition(self, partition_id: int) -> bool:
        return self.partitions is None or partition_id in self.partitions

    def and_(self, condition: PkFilter | frozenset[int]) -> Pushdown:
        """This pushdown and one more condition: on the pk, or partition ids to keep."""
        if isinstance(condition, PkFilter):
            return Pushdown(self.pk.and_(condition), self.partitions)
        return Pushdown(self.pk, condition if self.partitions is None else self.partitions & condition)


EVERYTHING = Pushdown()  # no filter: every row


def _condition(item: Any) -> str:
    return " ".join(map(repr, item)) if isinstance(item, (tuple, list)) else repr(item)


def _as_pk(value: Any, item: Any, text: bool) -> Pk:
    if text:
        if not isinstance(value, str):
            raise FilterError(_condition(item), f"{value!r} is not a VarChar primary key")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise FilterError(_condition(item), f"{value!r} is not an integer primary key")
    return int(value)


def pk_condition(op: str, value: Any, item: Any = None, text: bool = False) -> PkFilter:
    """One condition on the pk (VarChar when `text`, else int64) as a filter."""
    item = item if item is not None else ("pk", op, value)
    as_pk = functools.partial(_as_pk, item=item, text=text)
    if op in ("=", "=="):
        return PkFilter(values=(as_pk(value),))
    if op == "in":
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise FilterError(_condition(item), "'in' takes a list of primary keys")
        return PkFilter(values=tuple(sorted({as_pk(v) for v in value})))
    if op == "between":
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise FilterError(_condition(item), "'between' takes (low, high), both included")
        return PkFilter(low=as_pk(value[0]), high=as_pk(value[1]))
    bound = as_pk(value)
    if op in ("<", "<="):
        return PkFilter(high=bound, high_open=op == "<")
    if op in (">", ">="):
        return PkFilter(low=bound, low_open=op == ">")
    raise FilterError(_condition(item), f"unknown operator {op!r}; expected one of {', '.join(PK_OPS)}")


def parse_where(info: CollectionInfo, where: Sequence[Any] | None) -> Pushdown:
    """`where` ([(column, op, value), ...], all must hold) as a Pushdown; FilterError names
    a condition on another column, an unknown operator or partition, or a wrong value."""
    if not where:
        return EVERYTHING
    pk_name = info.schema.primary.name
    by_name = dict(zip(info.partition_names, info.partitions, strict=False))
    pushdown = EVERYTHING
    for item in where:
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise FilterError(_condition(item), "expected (column, op, value)")
        column, op, value = item
        op = str(op).lower()
        key = info.schema.partition_key
        if key is not None and column == key.name:  # its value picks the partition (the rows: the caller)
            values = [value] if op in ("=", "==") else list(value) if op == "in" else None
            if values is None:
                raise FilterError(_condition(item), "a partition key is filtered with '=' or 'in'")
            pushdown = pushdown.and_(frozenset(key_partitions(info, values)))
        elif column == pk_name:
            text = info.schema.primary.dtype is not DataType.INT64
            pushdown = pushdown.and_(pk_condition(op, value, item, text))
        elif column == PARTITION_COLUMN:
            names = [value] if op in ("=", "==") else list(value) if op == "in" else None
            if names is None:
                raise FilterError(_condition(item), "a partition is chosen with '=' or 'in'")
            unknown = [n for n in names if n not in by_name]
            if unknown:
                raise FilterError(_condition(item), f"no partition {unknown}; partitions: {sorted(by_name)}")
            pushdown = pushdown.and_(frozenset(by_name[n] for n in names))
        else:
            raise FilterError(
                _condition(item),
                f"only the primary key {pk_name!r}, {PARTITION_COLUMN!r} and a partition key can be filtered",
            )
    return pushdown


class StatsCache:
    """Stats logs already read, by (storage, path): a stats log is written once under a new
    path and never changed, so repeated lookups skip the read and the decode (most of a
    point lookup's time: a 200k-row segment's bloom filter is ~0.5 MB of base64 JSON).
    Least recently used first out past `size` entries."""

    def __init__(self, size: int = 2048) -> None:
        self._found: ReadCache[PkStats] = ReadCache(size)

    def get(self, storage: Storage, path: str) -> PkStats:
        return self._found.get((storage.uri, path), lambda: PkStats.from_bytes(storage.read_bytes(path)))


STATS = StatsCache()


def prune(storage: Storage, segments: Sequence[SegmentInfo], pushdown: Pushdown) -> list[SegmentInfo]:
    """The segments that may hold a matching row: in a kept partition, and with a stats log
    whose pk range (then bloom filter) may hold a matching pk. A segment without stats
    logs is kept (nothing proves it holds none)."""
    kept = []
    for seg in segments:
        if not pushdown.keeps_partition(seg.partition_id):
            continue
        if pushdown.pk.everything or not seg.statslogs:
            kept.append(seg)
            continue
        if pushdown.pk.empty:
            continue
        if any(pushdown.pk.may_hold(STATS.get(storage, s.path)) for s in seg.statslogs):
            kept.append(seg)
    if not pushdown.everything:
        log.info("pushdown kept %d of %d segments", len(kept), len(segments))
    return kept
