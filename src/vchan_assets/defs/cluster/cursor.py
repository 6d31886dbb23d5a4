"""The cursor of a cluster sensor: what a role's process keeps in memory, kept by Dagster
between the sensor's ticks as JSON in the records' one dict form (`model.Record`)."""

from __future__ import annotations

import json
import logging
from typing import ClassVar, Self

from vchan_assets.model import Record

log = logging.getLogger(__name__)


class SensorCursor(Record):
    """Base of a sensor's cursor, a dataclass whose fields all have defaults (the fresh
    cursor). An unreadable cursor is logged and replaced by a fresh one: the sensor starts
    over, as a restarted process would, instead of failing every tick."""

    # What a fresh cursor means for the sensor, for the log: a class keyword,
    # `class NodeCursor(SensorCursor, afresh="starting a new node")`.
    afresh: ClassVar[str] = "starting afresh"

    def __init_subclass__(cls, afresh: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if afresh is not None:
            cls.afresh = afresh

    @classmethod
    def parse(cls, raw: str | None) -> Self:
        if not raw:
            return cls()
        try:
            return cls.from_dict(json.loads(raw))
        except (ValueError, TypeError, AttributeError) as exc:  # not JSON, not an object, a bad field
            log.error("unreadable %s %r (%s): %s", cls.__name__, raw, exc, cls.afresh)
            return cls()

    def dump(self) -> str:
        return json.dumps(self.to_dict())
