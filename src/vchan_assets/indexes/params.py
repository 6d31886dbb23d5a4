"""Index parameters: what each index type accepts when it is created and searched, and the
values a build of one segment uses.

Build parameters (`vchan create-index --param name=value`, integers; the drop ratio a float):

| type     | parameters                                   | default                            |
|----------|----------------------------------------------|------------------------------------|
| FLAT     | none                                         | (nothing is built: searched exactly) |
| IVF_FLAT | nlist [1, 65536]                             | 4 * sqrt(rows of the segment)      |
| IVF_PQ   | nlist; m [1, dim], dividing dim; nbits [1, 16] | nlist as IVF_FLAT; m: the largest divisor of dim up to dim / 2; nbits 8 |
| HNSW     | M [2, 2048]; efConstruction [1, 2^31 - 1]    | M 16, efConstruction 200           |
| BIN_FLAT | none                                         | (nothing is built: searched exactly) |
| BIN_IVF_FLAT | nlist [1, 65536]                         | as IVF_FLAT                        |
| SPARSE_INVERTED_INDEX, SPARSE_WAND | drop_ratio_build [0, 1), a float | 0 (every value kept) |

Float vectors take FLAT, IVF_FLAT, IVF_PQ and HNSW with L2, IP or COSINE; binary vectors
take BIN_FLAT and BIN_IVF_FLAT with HAMMING or JACCARD; sparse vectors take
SPARSE_INVERTED_INDEX and SPARSE_WAND with IP (`check_fits`), as Milvus.

An index is trained on each segment's own vectors, so a build caps what the segment cannot
train: nlist at rows / 39 and 2^nbits at rows / 39 (faiss asks for 39 training points per
centroid). Segments under `MIN_ROWS_TO_BUILD` rows get no index files at all (as Milvus).

Search parameters (`Catalog.search(..., params={...})`): `nprobe` [1, 65536] for IVF
and BIN_IVF_FLAT (default: nlist / 16, at least 16, at most nlist), `ef` [1, 32768] for HNSW (default:
max(64, k); at least k), `drop_ratio_search` [0, 1) for the sparse indexes (default 0: the
search is exact). A parameter the index type does not take is an error.

A drop ratio r drops, per row (build) or per query (search), the floor(r * n) values of
least magnitude of its n values: Milvus' cut of a sparse vector's small values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from vchan_assets.model import (
    BINARY_INDEX_TYPES,
    BINARY_METRICS,
    FieldSchema,
    IndexParam,
    IndexType,
    MetricType,
)

POINTS_PER_CENTROID = 39
MAX_NLIST = 65536
MAX_K = 16384  # as Milvus' topk limit


@dataclass(frozen=True)
class Range:
    low: int
    high: int

    def check(self, name: str, value: object) -> int | float:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if not self.low <= value <= self.high:
            raise ValueError(f"{name}={value} is out of range [{self.low}, {self.high}]")
        return value


@dataclass(frozen=True)
class Ratio:
    """A float in [0, 1) (an integer 0 is read as 0.0)."""

    def check(self, name: str, value: object) -> int | float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not 0 <= value < 1:
            raise ValueError(f"{name}={value} is out of range [0, 1)")
        return float(value)


BUILD_PARAMS: dict[IndexType, dict[str, Range | Ratio]] = {
    IndexType.FLAT: {},
    IndexType.IVF_FLAT: {"nlist": Range(1, MAX_NLIST)},
    IndexType.IVF_PQ: {"nlist": Range(1, MAX_NLIST), "m": Range(1, 32768), "nbits": Range(1, 16)},
    IndexType.HNSW: {"M": Range(2, 2048), "efConstruction": Range(1, 2**31 - 1)},
    IndexType.SPARSE_INVERTED_INDEX: {"drop_ratio_build": Ratio()},
    IndexType.SPARSE_WAND: {"drop_ratio_build": Ratio()},
    IndexType.BIN_FLAT: {},
    IndexType.BIN_IVF_FLAT: {"nlist": Range(1, MAX_NLIST)},
}

SEARCH_PARAMS: dict[IndexType, dict[str, Range | Ratio]] = {
    IndexType.FLAT: {},
    IndexType.IVF_FLAT: {"nprobe": Range(1, MAX_NLIST)},
    IndexType.IVF_PQ: {"nprobe": Range(1, MAX_NLIST)},
    IndexType.HNSW: {"ef": Range(1, 32768)},
    IndexType.SPARSE_INVERTED_INDEX: {"drop_ratio_search": Ratio()},
    IndexType.SPARSE_WAND: {"drop_ratio_search": Ratio()},
    IndexType.BIN_FLAT: {},
    IndexType.BIN_IVF_FLAT: {"nprobe": Range(1, MAX_NLIST)},
}


def check_fits(field: FieldSchema, metric: MetricType, kind: IndexType | None = None) -> None:
    """ValueError when the metric (or the index type) is not one of the field's vectors:
    IP (SPARSE_INVERTED_INDEX, SPARSE_WAND) for sparse vectors, HAMMING and JACCARD
    (BIN_FLAT, BIN_IVF_FLAT) for binary vectors, the others for float vectors."""
    if field.is_sparse or (kind is not None and kind.is_sparse):
        _check_sparse_fits(field, metric, kind)
        return
    binary = field.is_binary_vector
    what = "binary vector" if binary else "float vector"
    if (metric in BINARY_METRICS) is not binary:
        allowed = sorted(m.value for m in MetricType if (m in BINARY_METRICS) is binary)
        raise ValueError(
            f"metric {metric} is not for the {what} field {field.name!r}: one of {', '.join(allowed)}"
        )
    if kind is not None and (kind in BINARY_INDEX_TYPES) is not binary:
        allowed = sorted(t.value for t in IndexType if (t in BINARY_INDEX_TYPES) is binary)
        raise ValueError(
            f"index type {kind} is not for the {what} field {field.name!r}: one of {', '.join(allowed)}"
        )


def _check_sparse_fits(field: FieldSchema, metric: MetricType, kind: IndexType | None) -> None:
    if kind is not None and not kind.is_sparse:
        sparse_kinds = ", ".join(t.value for t in IndexType if t.is_sparse)
        raise ValueError(f"a sparse float vector takes {sparse_kinds}, not {kind}")
    if not field.is_sparse:
        raise ValueError(f"{kind} indexes a sparse float vector, not a {field.type_name}")
    if metric is not MetricType.IP:
        raise ValueError(f"a sparse float vector is indexed and searched with metric IP only, not {metric}")


def default_metric(field: FieldSchema) -> MetricType:
    """The metric of a search on a field without an index: HAMMING for binary vectors, IP
    for sparse vectors, L2 for float vectors."""
    if field.is_sparse:
        return MetricType.IP
    return MetricType.HAMMING if field.is_binary_vector else MetricType.L2


def _checked(
    kind: IndexType | str, params: Mapping[str, object], allowed: dict[str, Range | Ratio], what: str
) -> dict[str, int | float]:
    out = {}
    for name, value in params.items():
        if name not in allowed:
            takes = ", ".join(allowed) or "no parameters"
            raise ValueError(f"{kind} takes {takes} as {what} parameters, not {name!r}")
        out[name] = allowed[name].check(name, value)
    return out


def build_params(kind: IndexType, params: Mapping[str, object], dim: int) -> tuple[IndexParam, ...]:
    """The build parameters of a new index, checked (ValueError naming the parameter), in
    the stored form: sorted by name, only those given."""
    checked = _checked(kind, params, BUILD_PARAMS[kind], "build")
    m = checked.get("m")
    if m is not None and dim % m:
        raise ValueError(f"m={m} must divide the dimension {dim}")
    return tuple(IndexParam(name, value) for name, value in sorted(checked.items()))


@dataclass(frozen=True)
class SegmentBuildParams:
    """What a build of one segment uses: the index's parameters, defaults filled in and
    capped by what the segment's rows can train."""

    nlist: int = 0
    m: int = 0
    nbits: int = 0
    M: int = 0
    ef_construction: int = 0
    drop_ratio_build: float = 0.0


def default_nlist(rows: int) -> int:
    return max(1, min(MAX_NLIST, int(4 * math.sqrt(rows))))


def default_m(dim: int) -> int:
    """The largest divisor of `dim` up to dim / 2 (two or more dimensions per sub-quantizer)."""
    return max(d for d in range(1, max(1, dim // 2) + 1) if dim % d == 0)


def for_segment(kind: IndexType, params: tuple[IndexParam, ...], dim: int, rows: int) -> SegmentBuildParams:
    if kind.is_sparse:
        return SegmentBuildParams(drop_ratio_build=float(next((p.value for p in params), 0.0)))
    given = {p.name: int(p.value) for p in params}
    trainable = max(1, rows // POINTS_PER_CENTROID)
    nlist = min(given.get("nlist", default_nlist(rows)), trainable)
    if kind in (IndexType.IVF_FLAT, IndexType.BIN_IVF_FLAT):
        return SegmentBuildParams(nlist=nlist)
    if kind is IndexType.IVF_PQ:
        nbits = max(1, min(given.get("nbits", 8), int(math.log2(trainable)) if trainable > 1 else 1))
        return SegmentBuildParams(nlist=nlist, m=given.get("m", default_m(dim)), nbits=nbits)
    if kind is IndexType.HNSW:
        return SegmentBuildParams(M=given.get("M", 16), ef_construction=given.get("efConstruction", 200))
    return SegmentBuildParams()


def search_params(kind: IndexType, params: Mapping[str, object], k: int) -> dict[str, int | float]:
    """The search parameters given, checked against the index type (ValueError naming the
    parameter); HNSW's `ef` must be at least k, as Milvus asks."""
    checked = _checked(kind, params, SEARCH_PARAMS[kind], "search")
    if "ef" in checked and checked["ef"] < k:
        raise ValueError(f"ef={checked['ef']} must be at least k={k}")
    return checked


# Every search parameter of any index type (a name has one range for every type taking it).
ANY_SEARCH_PARAMS = {name: allowed for ranges in SEARCH_PARAMS.values() for name, allowed in ranges.items()}


def any_search_params(params: Mapping[str, object]) -> dict[str, int | float]:
    """Search parameters that some index type takes, each a number in its range
    (ValueError naming the parameter); `search_params` checks them against the index."""
    return _checked("an index", params, ANY_SEARCH_PARAMS, "search")


def default_nprobe(nlist: int) -> int:
    return min(nlist, max(16, nlist // 16))


def default_ef(k: int) -> int:
    return max(64, k)
