"""A request's rows while they wait for the model and run (``Job``, ``Row``), and how a batch's outputs are handed
back to the requests they belong to. Used by the scheduler's threads (``batching.py``); no locks here: the scheduler
holds them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from ..model.heads import HeadOptions, Unit
from ..model.predictions import ChoiceInput, Input, TextInput
from ..model.runtime import Served
from ..model.tokenize import Encoder, Tokens
from .results import JobResult, TaskResult


@dataclass(eq=False)
class Job:
    tasks: tuple[str, ...]
    n: int  # inputs; each (task, input) makes one or more rows, task-major
    future: asyncio.Future[JobResult]
    loop: asyncio.AbstractEventLoop
    arrived_s: float
    served: Served  # the artifact revision it was admitted on, and is answered from
    truncation: str = "right"  # where the tokenizer cuts an input over the token limit
    options: HeadOptions = field(default_factory=HeadOptions)
    units: list[list[Unit]] = field(default_factory=list)  # per task, per input: its rows (set once tokenized)
    logits: list[np.ndarray | None] = field(default_factory=list)  # per row
    acts: list[np.ndarray | None] = field(default_factory=list)
    left: int = 0  # rows not yet computed
    queued: int = 0  # rows not yet taken by a batch
    started_s: float | None = None
    batches: int = 0
    failed: bool = False
    dropped: bool = False  # deadline passed, or caller gone: its rows left the queue (or never joined it)
    enqueued: bool = False  # its rows joined the queue (tokenizing is over)

    def __post_init__(self) -> None:
        self.left = self.queued = self.n * len(self.tasks)  # at least; the real count once tokenized

    @property
    def gone(self) -> bool:
        """Failed, dropped, or its caller went away (the future was cancelled): its rows need no computing."""
        return self.failed or self.dropped or self.future.cancelled()


@dataclass(frozen=True)
class Row:
    job: Job
    index: int  # position in its request's rows: task-major, then input, then the input's own rows
    task: str
    tokens: Tokens


def longest(encoder: Encoder, inp: Input) -> tuple[int, bool]:
    """An input's length in tokens, untruncated (a multiple-choice input: its longest pair), and whether a text of it
    was cut at the characters the tokenizer reads."""
    pairs = [TextInput(inp.text, c) for c in inp.choices] if isinstance(inp, ChoiceInput) else [inp]
    return max(encoder.count_tokens(pairs)), any(encoder.cut(pairs))  # type: ignore[arg-type]


def delivered(
    rows: list[Row], logits: list[np.ndarray], acts: list[np.ndarray | None]
) -> list[tuple[Job, JobResult | BaseException]]:
    """Record a batch's rows in their requests; the requests it completed, with their results."""
    for job in {id(r.job): r.job for r in rows}.values():
        job.batches += 1
    done: list[tuple[Job, JobResult | BaseException]] = []
    for k, row in enumerate(rows):
        job = row.job
        job.logits[row.index], job.acts[row.index] = logits[k], acts[k]
        job.left -= 1
        if job.left == 0 and not job.gone:
            done.append((job, result(job)))
    return done


def failed(rows: list[Row], exc: Exception) -> list[tuple[Job, JobResult | BaseException]]:
    jobs = {id(r.job): r.job for r in rows if not r.job.gone}
    for job in jobs.values():
        job.failed = True
    return [(job, exc) for job in jobs.values()]


def settle(items: list[tuple[asyncio.Future[JobResult], JobResult | BaseException]]) -> None:
    """On the event loop: hand each waiting request its result or its error."""
    for future, outcome in items:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def result(job: Job) -> JobResult:
    tasks, at = {}, 0
    for task, per_task in zip(job.tasks, job.units, strict=True):
        outputs, acts = [], []
        for unit in per_task:
            outputs.append([job.logits[i] for i in range(at, at + len(unit.rows))])
            acts.append([job.acts[i] for i in range(at, at + len(unit.rows))])
            at += len(unit.rows)
        # a fusion input's activations: the mean of its rows' (each the mean over that row's tokens)
        means = None if acts[0][0] is None else np.stack([np.mean(a, axis=0) for a in acts])  # (inputs, layers, adapters)
        tasks[task] = TaskResult(outputs, means, [u.truncated for u in per_task], per_task)  # type: ignore[arg-type]
    truncated = [any(t.truncated[i] for t in tasks.values()) for i in range(job.n)]
    started = job.started_s if job.started_s is not None else job.arrived_s
    return JobResult(tasks, truncated, (started - job.arrived_s) * 1000, job.batches)
