"""IO binding's buffers for ``runtime.OnnxRunner``: one set of bound inputs and outputs per batch shape, taken for a
run and given back, so that a run copies into buffers already there instead of allocating them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import onnxruntime as ort


@dataclass
class Bound:
    """One IO binding with its buffers, for one batch shape and one set of outputs."""

    binding: Any  # ort.IOBinding
    inputs: dict[str, ort.OrtValue]


class BindingPool:
    """Bound buffer sets by key, taken for one run and given back, so that concurrent runs of one shape (two
    tasks' batches in two threads) never share buffers. Keeps the ``capacity`` most recently used keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: OrderedDict[tuple[int, ...], list[Bound]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: tuple[int, ...]) -> Bound | None:
        with self._lock:
            free = self._free.get(key)
            return free.pop() if free else None

    def give(self, key: tuple[int, ...], bound: Bound) -> None:
        with self._lock:
            self._free.setdefault(key, []).append(bound)
            self._free.move_to_end(key)
            while len(self._free) > self.capacity:
                self._free.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())
