"""JSON codec for etcd values: a `"v": 1` schema version, validation, typed errors.

A value that is not JSON, has another schema version, or does not validate as its
model raises `MalformedValueError` naming the key.

The same bytes of a key decode once (an LRU of `DECODED_CACHE_SIZE` records): listings
that return the same values on every call (a search's segments, builds and checkpoints)
skip the per-field decoding. Only a model that cannot change is cached, since every caller
then shares one object: a frozen dataclass whose fields hold only scalars, enums, tuples
and such dataclasses (`immutable`; the stored records all are). Any other model decodes
anew on each call. A value that fails to decode is never cached: it raises every time.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
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
    """The record `raw` holds (cached by key, bytes and model when the model is `immutable`)."""
    if immutable(model):
        return _decoded(key, bytes(raw), model)  # type: ignore[arg-type]  # (classes are hashable)
    return _decode(key, raw, model)


def _decode(key: str, raw: bytes, model: type[M]) -> M:
    body = decode_dict(key, raw)
    try:
        return model.from_dict(body)  # type: ignore[attr-defined]
    except (ValueError, TypeError, KeyError) as exc:
        raise MalformedValueError(key, f"invalid {model.__name__}: {exc}") from None


_decoded = functools.lru_cache(maxsize=DECODED_CACHE_SIZE)(_decode)

_SCALARS = (int, float, str, bool, bytes, type(None))
_IMMUTABLE: dict[type, bool] = {}


def immutable(model: type) -> bool:
    """A frozen dataclass whose fields can only hold immutable values: one decoded object
    may be shared by every caller (checked once per class)."""
    if model not in _IMMUTABLE:
        _IMMUTABLE[model] = False  # (a record that holds itself is not judged twice)
        _IMMUTABLE[model] = (
            dataclasses.is_dataclass(model)
            and model.__dataclass_params__.frozen  # type: ignore[attr-defined]
            and all(_immutable_hint(h) for h in _field_hints(model))
        )
    return _IMMUTABLE[model]


def _field_hints(model: type) -> list[Any]:
    hints = typing.get_type_hints(model)
    return [hints[f.name] for f in dataclasses.fields(model)]


def _immutable_hint(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return all(_immutable_hint(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return all(_immutable_hint(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)
    if not isinstance(hint, type):
        return False
    return issubclass(hint, _SCALARS) or issubclass(hint, enum.Enum) or immutable(hint)
