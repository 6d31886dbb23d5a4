"""JSON codec for etcd values: a `"v": 1` schema version, validation, typed errors.

A value that is not JSON, has another schema version, or does not validate as its
model raises `MalformedValueError` naming the key.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Protocol, TypeVar

from vchan_assets.meta.errors import MalformedValueError

SCHEMA_VERSION = 1
# Decoded records kept (by key, bytes and model): a few MB at most.
DECODED_CACHE_SIZE = 16_384


class Model(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


M = TypeVar("M")


def encode(model: Model | dict[str, Any]) -> bytes:
    body = model if isinstance(model, dict) else model.to_dict()
    return json.dumps({"v": SCHEMA_VERSION, **body}, separators=(",", ":")).encode()


def decode_dict(key: str, raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedValueError(key, f"not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise MalformedValueError(key, f"expected a JSON object, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != SCHEMA_VERSION:
        raise MalformedValueError(key, f"schema version {version!r}, expected {SCHEMA_VERSION}")
    return body


def decode(key: str, raw: bytes, model: type[M]) -> M:
    """The record `raw` holds. Records are immutable (frozen dataclasses of tuples), so the
    same bytes decode once: listings that return the same values every call (a search's
    segments, builds and checkpoints) skip the per-field decoding (~0.25 ms a record)."""
    return _decoded(key, raw, model)  # type: ignore[arg-type]  # (classes are hashable)


@functools.lru_cache(maxsize=DECODED_CACHE_SIZE)
def _decoded(key: str, raw: bytes, model: type[M]) -> M:
    body = decode_dict(key, raw)
    try:
        return model.from_dict(body)  # type: ignore[attr-defined]
    except (ValueError, TypeError, KeyError) as exc:
        raise MalformedValueError(key, f"invalid {model.__name__}: {exc}") from None
