"""One model call for many requests of one task: pack, pad to the longest sequence in the batch (the runner may
pad further, to its bucket length), run, split.

No Ray and no HTTP here: the Ray deployment (``serving/app.py``) only queues requests per task and hands each
batch to ``BatchRunner.run``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .activations import token_means
from .predictions import TextInput
from .runtime import OnnxRunner


@dataclass(frozen=True)
class Job:
    """One request: some inputs for one task."""

    task: str
    inputs: tuple[TextInput, ...]
    enqueued_s: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class BatchStats:
    """What one model call did; ``report`` is set on exactly one job of each batch, so metrics count it once."""

    inputs: int
    tokens: int  # batch x padded length (the bucket's, when the runner buckets): what the model computed over
    model_ms: float
    report: bool


@dataclass(frozen=True)
class JobResult:
    logits: list[list[float]]  # per input, in label-id order
    truncated: list[bool]
    activations: list[list[list[float]]] | None  # per input: (layers, task adapters), mean over its tokens
    queue_ms: float
    batch: BatchStats


class BatchRunner:
    """Runs batches of jobs of one task through an OnnxRunner. Fusion tasks always compute activations over
    real tokens: the server reports their running mean as a metric (what pruning needs)."""

    def __init__(self, runner: OnnxRunner) -> None:
        self.runner = runner

    def run(self, task: str, jobs: Sequence[Job]) -> list[JobResult]:
        """One result per job, in order. Raises what the runner raises (unknown task, runtime failure)."""
        started = time.perf_counter()
        flat = [inp for job in jobs for inp in job.inputs]
        enc = self.runner.encoder.encode(flat)
        fusion = self.runner.artifact.task(task).kind == "fusion"
        out = self.runner.run(task, enc, return_fusion_activations=fusion)
        model_ms = (time.perf_counter() - started) * 1000
        per_input_acts = None
        if out.fusion_activations is not None:
            per_input_acts = token_means(out.fusion_activations, enc.attention_mask)  # (batch, layers, adapters)
        batch, seq = enc.input_ids.shape
        stats = BatchStats(len(flat), batch * self.runner.padded_length(seq), model_ms, report=False)
        results, start = [], 0
        for i, job in enumerate(jobs):
            end = start + len(job.inputs)
            acts = per_input_acts[start:end].tolist() if per_input_acts is not None else None
            results.append(
                JobResult(
                    logits=out.logits[start:end].tolist(),
                    truncated=enc.truncated[start:end],
                    activations=acts,
                    queue_ms=(started - job.enqueued_s) * 1000,
                    batch=BatchStats(stats.inputs, stats.tokens, stats.model_ms, report=i == 0),
                )
            )
            start = end
        return results
