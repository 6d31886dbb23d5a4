"""The merge of a search's candidates (`query.search.merge_hits`): per query, the k nearest,
ties in distance by pk; whether the candidates come as full query-by-query blocks (the
row-by-row order) or not (one sort of the table). No etcd, no Spark."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from vchan_assets.model import CollectionSchema, MetricType
from vchan_assets.query.search import SearchRequest, merge_hits

NQ, K = 7, 4


def request(metric: MetricType, pk_type: str = "int64") -> SearchRequest:
    schema = CollectionSchema.build("pk", {"vec": 4}, {"n": "int64"}, pk_type=pk_type)
    pk_arrow = pa.int64() if pk_type == "int64" else pa.string()
    return SearchRequest(
        field=schema.field("vec"),
        metric=metric,
        k=K,
        queries=np.zeros((NQ, 4), dtype=np.float32),
        index=None,
        params={},
        filter=None,
        output_fields=("n",),
        collection="c",
        pk="pk",
        scalars=("pk", "n"),
        result_schema=pa.schema(
            [("query", pa.int64()), ("pk", pk_arrow), ("distance", pa.float32()), ("n", pa.int64())]
        ),
    )


def block(rng: np.random.Generator, width: int, text: bool, drop: int = 0) -> pa.Table:
    """`width` candidates a query (a segment's hits), distances with many ties; `drop`
    candidates left out (a filtered or short segment)."""
    query = np.repeat(np.arange(NQ), width)
    pks = rng.choice(1_000, size=len(query), replace=False)
    keep = np.sort(rng.choice(len(query), size=len(query) - drop, replace=False))
    return pa.table(
        {
            "query": pa.array(query[keep]),
            "pk": pa.array([f"id-{p:04d}" for p in pks[keep]] if text else pks[keep]),
            "distance": pa.array(rng.integers(0, 4, size=len(query)).astype(np.float32)[keep]),
            "n": pa.array(pks[keep] * 10),
        }
    )


def expected(req: SearchRequest, hits: list[pa.Table]) -> list[tuple[int, object, float, int]]:
    sign = -1 if req.larger_is_nearer else 1
    rows = [
        r
        for h in hits
        for r in zip(*(h[c].to_pylist() for c in ("query", "pk", "distance", "n")), strict=True)
    ]
    rows.sort(key=lambda r: (r[0], sign * r[2], r[1]))
    out, taken = [], dict.fromkeys(range(NQ), 0)
    for row in rows:
        if taken[row[0]] < K:
            out.append(row)
            taken[row[0]] += 1
    return out


@pytest.mark.parametrize("metric", [MetricType.L2, MetricType.IP])
@pytest.mark.parametrize("pk_type", ["int64", "varchar(16)"])
@pytest.mark.parametrize("drop", [0, 3], ids=["full blocks", "rows left out"])
def test_the_merge_keeps_the_k_nearest_of_each_query_ties_by_pk(
    metric: MetricType, pk_type: str, drop: int
) -> None:
    rng = np.random.default_rng(7)
    req = request(metric, pk_type)
    text = pk_type != "int64"
    hits = [block(rng, K, text, drop), block(rng, K, text), block(rng, 2, text), block(rng, K + 3, text)]
    merged = merge_hits(req, hits)
    assert merged.schema == req.result_schema
    got = list(zip(*(merged[c].to_pylist() for c in ("query", "pk", "distance", "n")), strict=True))
    assert got == expected(req, hits)


def test_a_merge_of_one_segment_with_fewer_candidates_than_k_keeps_them_all() -> None:
    rng = np.random.default_rng(3)
    req = request(MetricType.L2)
    hits = [block(rng, 2, False)]
    merged = merge_hits(req, hits)
    assert merged.num_rows == NQ * 2
    assert list(
        zip(*(merged[c].to_pylist() for c in ("query", "pk", "distance", "n")), strict=True)
    ) == expected(req, hits)
