"""Errors declared by their fields and their message, once.

    class MalformedValueError(DeclaredError, MetaError):
        key: str
        reason: str
        message = "malformed value at {key}: {reason}"

A subclass of `DeclaredError` is made a dataclass: its annotated fields are its
constructor's arguments and its attributes, and `str(err)` is `message` formatted with
its attributes (a message that needs more than a field overrides `__str__`). It stays an
exception in every other way: compared and hashed by identity, its repr the usual
`Name('message')`, and picklable with its fields, so a Spark task can raise it and the
driver re-raise the same typed error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, dataclass_transform


@dataclass_transform(eq_default=False)
class DeclaredError(Exception):
    """Base of the errors that declare their fields and `message` template."""

    message: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(cls, eq=False, repr=False)  # in place: no slots

    def __str__(self) -> str:
        return self.message.format_map(vars(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException pickles `args`, which a dataclass's __init__ leaves empty.
        return type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.init)  # type: ignore[arg-type]
