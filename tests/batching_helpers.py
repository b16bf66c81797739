"""Shared by the scheduler tests (test_batching.py, test_deadlines.py): texts, a gate that holds the model thread
inside a batch so that requests queue behind it, and a scheduler with the batches it reports."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.scheduler.batching import BatchLimits, BatchStats, Scheduler
from tests.adapterhub_models import PAIRS, SENTENCES

TEXTS = [TextInput(s) for s in SENTENCES] + [TextInput(a, b) for a, b in PAIRS]


async def until(check: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    """Wait (on the event loop) until ``check()`` holds; an AssertionError naming ``what`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {within_s} s")
        await asyncio.sleep(0.005)


class Gate:
    """Holds the model thread inside its next run until ``release``: lets a test queue requests while a batch runs."""

    def __init__(self, runner: OnnxRunner) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()
        real = runner.run

        def run(*args, **kwargs):
            self.entered.set()
            self.release.wait(30)
            return real(*args, **kwargs)

        runner.run = run  # instrumentation only: the real session still computes every batch

    def close(self) -> None:
        self.entered.clear()
        self.release.clear()

    async def hold(self, request: Coroutine[Any, Any, Any]) -> asyncio.Future:
        """Close the gate, start ``request`` and return it (running) once its batch holds the model."""
        self.close()
        running = asyncio.ensure_future(request)
        await until(self.entered.is_set, "in the model")
        return running


def scheduled(runner: OnnxRunner, **limits: Any) -> tuple[Scheduler, list[BatchStats], Gate]:
    """A scheduler on ``runner`` with BatchLimits(**limits), the batches it reports (appended as they run), and a gate
    on its model."""
    batches: list[BatchStats] = []
    return Scheduler(runner, BatchLimits(**limits), batches.append), batches, Gate(runner)
