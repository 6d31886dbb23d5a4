"""What a search is asked to do, as one value: `SearchOptions`.

    SearchOptions(k=10, field=None, metric=None, filter=None, as_of=None, params=None,
                  output_fields=())

Made once where a search is asked for (`Catalog.search` and `Catalog.search_dataframe`
from their keywords, `vchan search` from its flags, or by the caller) and passed whole to
`query.search.search` and `query.batch_search.search_table`, down to the check of the
request against the collection (`query.search.check_request`).

The options are checked when made, on their own: k, the metric's name, the search
parameters' names and values, the output fields and the filter's type. What depends on the
collection (the vector field, the metric and parameters against its index, the output
fields against its schema) is checked by `check_request`; `as_of` against the time-travel
window when the search resolves it (`query.asof`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypedDict, Unpack

import pyarrow.compute as pc

from vchan_assets.errors import DeclaredError
from vchan_assets.indexes.params import MAX_K, any_search_params
from vchan_assets.model import MetricType


class SearchError(DeclaredError, ValueError):
    """A search that cannot run as asked: nothing was read. `collection` is "" for
    options refused on their own (`SearchOptions`), before any collection is named."""

    collection: str
    reason: str

    def __str__(self) -> str:
        where = f" {self.collection!r}" if self.collection else ""
        return f"cannot search{where}: {self.reason}"


@dataclass(frozen=True, eq=False)
class SearchOptions:
    """A search's options, checked when made (`SearchError` naming the first one wrong).

    Invariants once made: `k` is an integer in [1, MAX_K]; `metric` is None (the index's,
    L2 without one) or a `MetricType` (a name is taken in any case); `params` is a
    read-only mapping of search parameter names (`nprobe`, `ef`) to integers in their
    range; `output_fields` is a tuple of names; `filter` is None, a pandas expression (a
    string) or a `pyarrow.compute` expression; `field` is None or a name. `as_of` is
    anything `query.asof.resolve_as_of` takes (checked when the search runs)."""

    k: int = 10
    field: str | None = None
    metric: MetricType | str | None = None
    filter: str | pc.Expression | None = None
    as_of: Any = None
    params: Mapping[str, object] | None = None
    output_fields: Sequence[str] = ()

    def __post_init__(self) -> None:
        def error(reason: str) -> SearchError:
            return SearchError("", reason)

        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= MAX_K:
            raise error(f"k must be an integer in [1, {MAX_K}], got {k!r}")
        if self.field is not None and not isinstance(self.field, str):
            raise error(f"field must be a field name, got {self.field!r}")
        if self.metric is not None:
            try:
                object.__setattr__(self, "metric", MetricType(str(self.metric).upper()))
            except ValueError:
                known = ", ".join(m.value for m in MetricType)
                raise error(f"unknown metric {self.metric!r}: one of {known}") from None
        if self.filter is not None and not isinstance(self.filter, str | pc.Expression):
            kind = type(self.filter).__name__
            raise error(f"filter must be a string or a pyarrow.compute expression, got {kind}")
        if not isinstance(self.params or {}, Mapping):
            raise error(f"params must be a mapping of search parameters, got {self.params!r}")
        try:
            object.__setattr__(self, "params", MappingProxyType(any_search_params(self.params or {})))
        except ValueError as exc:
            raise error(str(exc)) from None
        given = self.output_fields
        fields = tuple(given) if isinstance(given, Iterable) and not isinstance(given, str) else None
        if fields is None or not all(isinstance(f, str) for f in fields):
            raise error(f"output_fields must be a list of field names, got {given!r}")
        object.__setattr__(self, "output_fields", fields)

    def _key(self) -> tuple[Any, ...]:
        # An Expression's == builds an expression: compare filters by their canonical text.
        filter_key = (
            ("expression", str(self.filter)) if isinstance(self.filter, pc.Expression) else self.filter
        )
        params = tuple(sorted((self.params or {}).items()))
        return (self.k, self.field, self.metric, filter_key, self.as_of, params, tuple(self.output_fields))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SearchOptions):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:
        # A read-only mapping does not pickle: ship its items (a Spark closure may hold options).
        params = dict(self.params or {})
        return type(self), (
            self.k,
            self.field,
            self.metric,
            self.filter,
            self.as_of,
            params,
            self.output_fields,
        )


class SearchKeywords(TypedDict, total=False):
    """`SearchOptions`' fields as keywords (`Catalog.search(..., k=5, filter=...)`)."""

    k: int
    field: str | None
    metric: MetricType | str | None
    filter: str | pc.Expression | None
    as_of: Any
    params: Mapping[str, object] | None
    output_fields: Sequence[str]


def search_options(
    collection: str, options: SearchOptions | None = None, **keywords: Unpack[SearchKeywords]
) -> SearchOptions:
    """The options of a search of `collection`: `options` as given, or made from
    `keywords` (not both); options refused are a SearchError naming `collection`."""
    if options is not None:
        if not isinstance(options, SearchOptions):
            raise SearchError(collection, f"options must be SearchOptions, got {type(options).__name__}")
        if keywords:
            given = ", ".join(sorted(keywords))
            raise SearchError(collection, f"give SearchOptions or keywords, not both (keywords: {given})")
        return options
    try:
        return SearchOptions(**keywords)
    except SearchError as exc:
        raise SearchError(collection, exc.reason) from None
