"""The model replica: a thin Ray Serve shell around BatchRunner, with one dynamic-batching queue per task so
requests of different tasks never wait for each other."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any

from ray import serve

from .artifact import load_artifact
from .batching import BatchRunner, Job, JobResult
from .predictions import TextInput
from .runtime import OnnxRunner


class ModelReplica:
    """One ONNX Runtime session per replica (CUDA when there, else CPU with the replica's CPUs as threads)."""

    def __init__(self, artifact_dir: str, max_batch_size: int, batch_wait_timeout_s: float, threads: int | None = None) -> None:
        artifact = load_artifact(artifact_dir)
        self.runner = BatchRunner(OnnxRunner(artifact, threads=threads or len(os.sched_getaffinity(0))))
        self.queues: dict[str, Callable[[Job], Coroutine[Any, Any, JobResult]]] = {}
        for task in artifact.tasks:
            # batch_size_fn: a request with k inputs takes k places of max_batch_size, so the model never
            # sees more than max_batch_size texts at once
            self.queues[task] = serve.batch(
                max_batch_size=max_batch_size,
                batch_wait_timeout_s=batch_wait_timeout_s,
                batch_size_fn=lambda jobs: sum(len(j.inputs) for j in jobs),
            )(self._batch_handler(task))

    def _batch_handler(self, task: str) -> Callable[[list[Job]], Coroutine[Any, Any, list[JobResult]]]:
        async def handle(jobs: list[Job]) -> list[JobResult]:
            # the session runs in a worker thread so this replica keeps taking requests for other tasks
            return await asyncio.to_thread(self.runner.run, task, jobs)

        return handle

    async def classify(self, task: str, inputs: list[tuple[str, str | None]], want_activations: bool) -> JobResult:
        job = Job(task, tuple(TextInput(t, p) for t, p in inputs), want_activations)
        return await self.queues[task](job)

    def info(self) -> dict[str, Any]:
        return {"provider": self.runner.runner.provider, "tasks": list(self.queues)}


def deployment(replicas: int, threads: int, max_batch_size: int, max_queued: int, max_ongoing: int | None = None) -> Any:
    """The Serve deployment of ModelReplica, each replica reserving ``threads`` CPUs for its session.
    ``max_ongoing_requests`` defaults to two full batches (Serve's default of 5 would silently cap a batch at 5);
    past it, up to ``max_queued`` requests wait in the caller and the rest are refused (503)."""
    return serve.deployment(
        ModelReplica,
        name="model",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing or 2 * max_batch_size,
        max_queued_requests=max_queued,
        ray_actor_options={"num_cpus": threads},
    )
