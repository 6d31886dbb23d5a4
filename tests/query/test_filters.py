"""Scalar filters with Milvus' JSON paths and array functions (`query.filters`), evaluated
over rows as the search and the reads hold them (no etcd)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from vchan_assets.query.filters import FilterExpressionError, filter_mask, key_values

ROWS = pa.table(
    {
        "n": pa.array([1, 2, 3, 4], pa.int8()),
        "meta": pa.array(
            [
                json.dumps({"color": "red", "size": 3, "dims": [1, 2]}),
                json.dumps({"color": "blue", "size": 10}),
                None,
                json.dumps({"color": "red", "tags": ["a", "b"]}),
            ]
        ),
        "tags": pa.array([["x", "y"], [], None, ["y"]], pa.list_(pa.string())),
    }
)


def picked(expression: str) -> list[int]:
    mask = filter_mask(expression, ROWS, json_fields=("meta",))
    return [n for n, keep in zip(ROWS["n"].to_pylist(), mask, strict=True) if keep]


@pytest.mark.parametrize(
    ("expression", "rows"),
    [
        ("meta['color'] == 'red'", [1, 4]),
        ('meta["color"] == "red" and n > 1', [4]),
        ("meta['size'] > 5", [2]),
        ("meta['dims'][1] == 2", [1]),
        ("meta['missing'] == 1", []),
        ("array_contains(tags, 'y')", [1, 4]),
        ("ARRAY_CONTAINS_ALL(tags, ['x', 'y'])", [1]),
        ("array_contains_any(tags, ['x', 'z']) or n == 2", [1, 2]),
        ("array_length(tags) == 0", [2]),
        ("json_contains(meta['tags'], 'b')", [4]),
        ("not array_contains(tags, 'y')", [2, 3]),
        ("n >= 3", [3, 4]),
    ],
)
def test_json_paths_and_array_functions_select_the_rows(expression: str, rows: list[int]) -> None:
    assert picked(expression) == rows


def test_a_filter_that_cannot_be_evaluated_says_which_and_why() -> None:
    with pytest.raises(FilterExpressionError, match=r"filter 'nope > 1' failed: UndefinedVariableError"):
        picked("nope > 1")
    with pytest.raises(FilterExpressionError, match="takes an array field or a JSON path"):
        picked("array_contains(n + 1, 3)")
    with pytest.raises(FilterExpressionError, match="is not a condition on each row"):
        picked("n + 1")


def test_a_name_that_is_no_column_is_a_key_of_the_dynamic_field() -> None:
    rows = ROWS.append_column(
        "$meta", pa.array([json.dumps({"color": "red"}), None, "{}", json.dumps({"color": "blue"})])
    )
    mask = filter_mask("color == 'red' or n == 3", rows, json_fields=("meta", "$meta"), dynamic="$meta")
    assert mask.tolist() == [True, False, True, False]
    with pytest.raises(FilterExpressionError, match="UndefinedVariableError"):
        filter_mask("color == 'red'", ROWS, json_fields=("meta",), dynamic="$meta")  # no such column


@pytest.mark.parametrize(
    ("expression", "values"),
    [
        ("tenant == 'a'", ["a"]),
        ("tenant in ['a', 'b'] and n > 3", ["a", "b"]),
        ("n > 3 and tenant == 'b' and tenant in ['a', 'b']", ["b"]),
        ("tenant == 'a' or n > 3", None),  # not required of every row
        ("n > 3", None),
        ("tenant != 'a'", None),
        ("not a python expression (", None),
    ],
)
def test_the_values_a_filter_requires_of_a_field(expression: str, values: list[str] | None) -> None:
    assert key_values(expression, "tenant") == values
