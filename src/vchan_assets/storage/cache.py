"""What was read from files that are written once and never changed (binlogs, stats logs,
index files), kept in memory by key: the same key always means the same value."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ReadCache(Generic[V]):
    """Values by key, the least recently used dropped once their weights pass `budget`
    (`weigh`: a value's share of it; by default 1, a budget of entries). A value over the
    whole budget is kept alone. Thread-safe; a value two threads miss at once is loaded twice
    and kept once."""

    def __init__(self, budget: int, weigh: Callable[[V], int] = lambda _: 1) -> None:
        self.budget = budget
        self.weigh = weigh
        self.lock = threading.Lock()
        self.found: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self.held = 0

    def get(self, key: Hashable, load: Callable[[], V]) -> V:
        with self.lock:
            if key in self.found:
                self.found.move_to_end(key)
                return self.found[key][0]
        value = load()
        weight = self.weigh(value)
        with self.lock:
            if key not in self.found:
                self.found[key] = (value, weight)
                self.held += weight
            while self.held > self.budget and len(self.found) > 1:
                _, (_, dropped) = self.found.popitem(last=False)
                self.held -= dropped
        return value
