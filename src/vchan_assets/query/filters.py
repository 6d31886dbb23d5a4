"""Scalar filters of searches and reads: a pandas expression over the fields, with Milvus'
JSON paths and array functions.

`"n > 3 and tag == 'a'"` is evaluated by pandas (`DataFrame.eval`) over the rows' scalar
columns. Before that, what pandas cannot evaluate is computed here, each into a column of
its own that the expression then names:

- a JSON path, `meta["color"]` or `meta["dims"][0]`: the value at that path of each row's
  JSON (None where the row has none or the path is missing; numbers as floats when every
  value found is a number, so `meta["size"] > 3` compares numbers);
- a key of the dynamic field, `color == 'red'` (a name that is no column of the rows, in a
  collection whose schema has the dynamic field `$meta`): the value of that key;
- `array_contains(tags, "x")`, `array_contains_all(tags, ["x", "y"])`,
  `array_contains_any(tags, ["x", "y"])` and `array_length(tags)`, Milvus' array
  functions (case does not matter: `ARRAY_CONTAINS` too); `json_contains(meta["tags"], "x")`
  for a JSON list.

The expression is parsed with Python's `ast`, so a string that is not an expression fails
with the parser's message; `FilterExpressionError` names the expression.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from vchan_assets.fields import key_array, vchannel_index
from vchan_assets.model import CollectionInfo, DataType


class FilterExpressionError(ValueError):
    """A filter expression that cannot be evaluated; the message names it and why."""


_ARRAY_FUNCTIONS: dict[str, Callable[[Any, Any], Any]] = {
    "array_contains": lambda values, x: x in values,
    "array_contains_all": lambda values, xs: all(x in values for x in xs),
    "array_contains_any": lambda values, xs: any(x in values for x in xs),
    "json_contains": lambda values, x: isinstance(values, list) and x in values,
}


def filter_mask(
    expression: str, rows: pa.Table, json_fields: Sequence[str] = (), dynamic: str | None = None
) -> np.ndarray:
    """Per row of `rows`: whether `expression` holds. `json_fields` are the columns that
    hold JSON text (their paths may be used); `dynamic`, the dynamic field's column, whose
    keys a name that is not a column stands for (`color == 'red'`, as in Milvus)."""
    frame = rows.to_pandas()
    rewrite = _Rewrite(frame, set(json_fields), dynamic)
    try:
        tree = rewrite.visit(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError:
        tree = None  # not Python: pandas' own parser says why
    text = ast.unparse(tree) if tree is not None and rewrite.columns else expression
    try:
        found = frame.eval(text)
    except Exception as exc:  # pandas raises many kinds for a mistaken expression
        raise FilterExpressionError(f"filter {expression!r} failed: {type(exc).__name__}: {exc}") from None
    mask = np.asarray(found)
    if mask.dtype != bool or mask.shape != (rows.num_rows,):
        raise FilterExpressionError(f"filter {expression!r} is not a condition on each row")
    return mask


class _Rewrite(ast.NodeTransformer):
    """JSON paths and array functions replaced by columns of `frame` computed here."""

    def __init__(self, frame: pd.DataFrame, json_fields: set[str], dynamic: str | None) -> None:
        self.frame = frame
        self.json_fields = json_fields
        self.dynamic = dynamic if dynamic in frame else None
        self.columns = 0
        self._parsed: dict[str, list[Any]] = {}

    def _column(self, values: list[Any]) -> ast.Name:
        name = f"__filter_{self.columns}"
        self.columns += 1
        found = [v for v in values if v is not None]
        numeric = found and all(isinstance(v, int | float) and not isinstance(v, bool) for v in found)
        if numeric:
            self.frame[name] = pd.Series([np.nan if v is None else float(v) for v in values], dtype=float)
        else:
            self.frame[name] = pd.Series(values, dtype=object)
        return ast.Name(id=name, ctx=ast.Load())

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if self.dynamic is None or node.id in self.frame:
            return node
        return self._column([_follow(doc, [node.id]) for doc in self._documents(self.dynamic)])

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        path = _json_path(node)
        if path is None or path[0] not in self.json_fields:
            return self.generic_visit(node)
        return self._column([_follow(doc, path[1:]) for doc in self._documents(path[0])])

    def visit_Call(self, node: ast.Call) -> ast.AST:
        name = node.func.id.lower() if isinstance(node.func, ast.Name) else ""
        if name == "array_length" and len(node.args) == 1:
            values = self._values(node.args[0], name)
            return self._column([None if v is None else len(v) for v in values])
        if name in _ARRAY_FUNCTIONS and len(node.args) == 2:
            values = self._values(node.args[0], name)
            wanted = _literal(node.args[1], name)
            test = _ARRAY_FUNCTIONS[name]
            column = self._column([v is not None and bool(test(v, wanted)) for v in values])
            self.frame[column.id] = self.frame[column.id].astype(bool)
            return column
        node.args = [self.visit(arg) for arg in node.args]  # a function's name is no field
        node.keywords = [self.visit(k) for k in node.keywords]
        return node

    def _values(self, node: ast.expr, function: str) -> list[Any]:
        """An array column's or a JSON path's values, as Python lists (None when null)."""
        if isinstance(node, ast.Name) and node.id in self.frame and node.id not in self.json_fields:
            return [None if v is None else list(v) for v in self.frame[node.id]]
        if isinstance(node, ast.Name) and self.dynamic is not None and node.id not in self.frame:
            return [_follow(doc, [node.id]) for doc in self._documents(self.dynamic)]
        path = _json_path(node)
        if path is not None and path[0] in self.json_fields:
            return [_follow(doc, path[1:]) for doc in self._documents(path[0])]
        raise FilterExpressionError(
            f"{function}() takes an array field or a JSON path, got {ast.unparse(node)}"
        )

    def _documents(self, field: str) -> list[Any]:
        if field not in self._parsed:
            self._parsed[field] = [None if t is None else json.loads(t) for t in self.frame[field]]
        return self._parsed[field]


def key_partitions_of(info: CollectionInfo, expression: object) -> set[int] | None:
    """The partitions a filter keeps by its condition on the collection's partition key
    (`tenant == 'a'`, `tenant in ['a', 'b']`, in a conjunction), as Milvus prunes them;
    None when it has none (every partition is searched)."""
    key = info.schema.partition_key
    if key is None or not isinstance(expression, str):
        return None
    values = key_values(expression, key.name)
    return None if values is None else key_partitions(info, values)


def key_partitions(info: CollectionInfo, values: Sequence[Any]) -> set[int]:
    """The hidden partitions the partition key's `values` hash to (values of another type
    than the key's match no row, so pick none)."""
    key = info.schema.partition_key
    assert key is not None
    found = [v for v in values if isinstance(v, str) == (key.dtype is DataType.VARCHAR)]
    index = vchannel_index(key_array(found) if found else np.empty(0, np.int64), len(info.partitions))
    return {info.partitions[i] for i in index.tolist()}


def key_values(expression: str, name: str) -> list[Any] | None:
    """The values a filter allows for the field `name` by a condition every matching row
    meets (`name == v`, `name in [v, w]`, alone or in an `and`); None when there is none."""
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        return None
    conjuncts = tree.values if isinstance(tree, ast.BoolOp) and isinstance(tree.op, ast.And) else [tree]
    allowed: set[Any] | None = None
    for node in conjuncts:
        found = _values_of(node, name)
        if found is not None:
            allowed = set(found) if allowed is None else allowed & set(found)
    return None if allowed is None else sorted(allowed, key=repr)


def _values_of(node: ast.AST, name: str) -> list[Any] | None:
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.left, ast.Name)):
        return None
    if node.left.id != name:
        return None
    try:
        value = ast.literal_eval(node.comparators[0])
    except ValueError:
        return None
    if isinstance(node.ops[0], ast.Eq):
        return [value]
    if isinstance(node.ops[0], ast.In) and isinstance(value, list | tuple | set):
        return list(value)
    return None


def _json_path(node: ast.AST) -> list[Any] | None:
    """`meta["a"][0]` -> ["meta", "a", 0]; None when `node` is not such a path."""
    keys: list[Any] = []
    while isinstance(node, ast.Subscript):
        if not isinstance(node.slice, ast.Constant) or not isinstance(node.slice.value, str | int):
            return None
        keys.append(node.slice.value)
        node = node.value
    if not isinstance(node, ast.Name) or not keys:
        return None
    return [node.id, *reversed(keys)]


def _follow(document: Any, keys: Sequence[Any]) -> Any:
    for key in keys:
        if isinstance(document, dict) and isinstance(key, str):
            document = document.get(key)
        elif isinstance(document, list) and isinstance(key, int) and -len(document) <= key < len(document):
            document = document[key]
        else:
            return None
    return document


def _literal(node: ast.expr, function: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise FilterExpressionError(f"{function}() takes a literal value, got {ast.unparse(node)}") from None
