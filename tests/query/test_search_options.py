"""A search's options as one value: frozen, checked when made, normalized, and refused
naming the collection when the catalog makes them from keywords."""

from __future__ import annotations

import dataclasses
import pickle

import pyarrow.compute as pc
import pytest

from vchan_assets.model import MetricType
from vchan_assets.query.search_options import SearchError, SearchOptions, search_options


def test_options_are_frozen_and_their_params_read_only() -> None:
    options = SearchOptions(k=5, params={"ef": 64})

    with pytest.raises(dataclasses.FrozenInstanceError):
        options.k = 6  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.params["ef"] = 128  # type: ignore[index]
    assert options.k == 5 and dict(options.params or {}) == {"ef": 64}


def test_options_are_normalized_and_do_not_share_what_the_caller_keeps() -> None:
    params = {"nprobe": 8}
    fields = ["n", "tag"]

    options = SearchOptions(metric="cosine", params=params, output_fields=fields)
    assert SearchOptions(output_fields=(f for f in fields)).output_fields == ("n", "tag")
    params["nprobe"] = 9
    fields.append("x")

    assert options.metric is MetricType.COSINE
    assert dict(options.params or {}) == {"nprobe": 8}
    assert options.output_fields == ("n", "tag")
    assert SearchOptions().params == {} and SearchOptions().metric is None


def test_equal_options_compare_and_hash_equal() -> None:
    one = SearchOptions(k=3, metric="ip", params={"ef": 8}, filter=pc.field("n") > 3, output_fields=["n"])
    same = SearchOptions(
        k=3, metric=MetricType.IP, params={"ef": 8}, filter=pc.field("n") > 3, output_fields=("n",)
    )

    assert one == same and hash(one) == hash(same) and len({one, same}) == 1
    assert one != SearchOptions(
        k=3, metric="ip", params={"ef": 8}, filter=pc.field("n") > 4, output_fields=["n"]
    )
    assert one != SearchOptions(
        k=3, metric="ip", params={"ef": 9}, filter=pc.field("n") > 3, output_fields=["n"]
    )
    assert SearchOptions(filter="n > 3") != SearchOptions(filter="n > 4")


def test_options_round_trip_through_pickle() -> None:
    options = SearchOptions(k=3, filter=pc.field("n") > 3, as_of="2026-01-01T00:00:00Z", params={"ef": 8})

    copy = pickle.loads(pickle.dumps(options))

    assert copy == options
    assert (copy.k, copy.as_of, dict(copy.params or {})) == (3, "2026-01-01T00:00:00Z", {"ef": 8})
    assert isinstance(copy.filter, pc.Expression) and copy.filter.equals(options.filter)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k": 0}, r"k must be an integer in \[1, 16384\], got 0"),
        ({"k": 16385}, r"k must be an integer in \[1, 16384\], got 16385"),
        ({"k": True}, r"k must be an integer in \[1, 16384\], got True"),
        ({"k": 2.5}, r"k must be an integer in \[1, 16384\], got 2.5"),
        ({"metric": "l3"}, "unknown metric 'l3': one of L2, IP, COSINE"),
        (
            {"params": {"nlist": 8}},
            "an index takes nprobe, ef, drop_ratio_search as search parameters, not 'nlist'",
        ),
        ({"params": {"ef": "64"}}, "ef must be an integer, got '64'"),
        ({"params": {"nprobe": 0}}, r"nprobe=0 is out of range \[1, 65536\]"),
        ({"params": [("ef", 64)]}, "params must be a mapping of search parameters"),
        ({"output_fields": "tag"}, "output_fields must be a list of field names, got 'tag'"),
        ({"output_fields": 5}, "output_fields must be a list of field names, got 5"),
        ({"output_fields": ["n", 5]}, r"output_fields must be a list of field names, got \['n', 5\]"),
        ({"filter": 3}, "filter must be a string or a pyarrow.compute expression, got int"),
        ({"field": 3}, "field must be a field name, got 3"),
    ],
)
def test_bad_options_are_refused_when_made(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SearchError, match=message) as caught:
        SearchOptions(**kwargs)  # type: ignore[arg-type]

    assert caught.value.collection == ""
    assert str(caught.value) == f"cannot search: {caught.value.reason}"

    with pytest.raises(SearchError, match=message) as named:
        search_options("books", **kwargs)  # type: ignore[arg-type]

    assert str(named.value).startswith("cannot search 'books': ")


def test_options_are_given_whole_or_as_keywords_not_both() -> None:
    options = SearchOptions(k=4)

    assert search_options("books", options) is options
    assert search_options("books", k=4) == options
    with pytest.raises(SearchError, match=r"give SearchOptions or keywords, not both \(keywords: k\)"):
        search_options("books", options, k=5)
    with pytest.raises(SearchError, match="options must be SearchOptions, got int"):
        search_options("books", 5)  # type: ignore[arg-type]
