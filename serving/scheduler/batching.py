"""Continuous batching for one replica, with no timer at low load.

A request is tokenized when it arrives (in a tokenizer thread, off the event loop) and its inputs join one queue as
rows — one row per input and task, so a request for several tasks adds each input once per task; a multiple-choice
input adds one row per choice and a question-answering input one per window of its context (``model/heads.py``), and
each such row counts as one against the limits, as an input does. One model thread
sends batches to the model, one at a time: as soon as the model is free it takes the rows queued, oldest first and
of any tasks (the graph selects each row's fusion and head), up to ``max_batch_size`` rows and
``max_batch_tokens`` padded tokens (rows x the longest row, at the runner's bucket length), and while that batch
runs the next one forms. A single
request at an idle server therefore runs at once, and a request with more inputs than a batch holds is split over
several batches, never refused. A request that finds ``max_queued`` requests already waiting is refused at once
(``Overloaded``), so overload never builds a queue that answers late.

A request still waiting at its deadline (no row taken by a batch) leaves the queue and fails at once
(``DeadlineExceeded``); one whose caller goes away (``submit`` cancelled, as Serve does when a client disconnects)
loses its rows not yet taken the same way. The model never runs a dropped row.

The event loop only hands a request to a tokenizer thread and awaits its future; the model thread posts each
batch's finished requests back to the loop in one call. So a request costs the loop two wake-ups, whatever the
batching does. No Ray and no HTTP here: the deployment (``app.py``) only submits requests and reports results.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from fusionserve.errors import FusionServeError, InputError

from ..model.activations import token_means
from ..model.heads import HeadOptions, Unit, head, row_key, units
from ..model.predictions import Input, TextInput
from ..model.runtime import OnnxRunner, Served
from ..options import check_ranges, default
from .jobs import Job, Row, delivered, failed, longest, settle
from .results import BatchSpan, BatchStats, JobResult, shares


class Overloaded(FusionServeError):
    """The replica already holds as many waiting requests as it may; the caller should retry later."""


class DeadlineExceeded(FusionServeError):
    """A request's deadline passed while it waited for the model: it was dropped before the model ran any of it."""


class TooManyTokens(FusionServeError):
    """Strict mode: inputs over the token limit. ``over``: (input index, its tokens, its text was cut first) each."""

    def __init__(self, over: list[tuple[int, int, bool]], limit: int) -> None:
        self.over, self.limit = over, limit
        super().__init__(f"{len(over)} input(s) over the token limit of {limit}")


class TooManyRows(FusionServeError):
    """A request makes more rows than it may (each choice of a multiple-choice input and each window of a
    question-answering context is a row). ``rows``: per input, the rows it makes (first task's count)."""

    def __init__(self, total: int, limit: int, rows: list[int]) -> None:
        self.total, self.limit, self.rows = total, limit, rows
        super().__init__(f"{total} rows over the limit of {limit}")


@dataclass(frozen=True)
class BatchLimits:
    """How batches form. ``max_queued``: requests that may wait for the model at once; ``batch_wait_ms``: how long a
    batch may wait to fill once the model is free (0: it leaves at once). Defaults and checks are the serve options'
    (serving/options.py). Raises FusionServeError for a value out of range."""

    max_batch_size: int = default("max_batch_size")
    max_batch_tokens: int = default("max_batch_tokens")
    max_queued: int = default("max_queued")
    batch_wait_ms: float = default("batch_wait_ms")

    def __post_init__(self) -> None:
        check_ranges(asdict(self))

    def check_fits(self, max_seq_len: int) -> None:
        """Raises FusionServeError when a batch could not hold one input of ``max_seq_len`` tokens (the artifact's
        token limit): the one bound of max_batch_tokens that depends on the artifact."""
        if self.max_batch_tokens < max_seq_len:
            raise FusionServeError(
                f"max_batch_tokens = {self.max_batch_tokens} cannot hold one input of the artifact's token limit "
                f"({max_seq_len}); allowed: >= {max_seq_len}"
            )


class Scheduler:
    """Queues requests' rows and runs them through ``runner`` in batches (see the module docstring). Its model
    thread starts at the first ``submit``. ``on_batch`` is called with every batch's figures, in the model thread."""

    def __init__(self, runner: OnnxRunner, limits: BatchLimits, on_batch: Callable[[BatchStats], None] | None = None) -> None:
        limits.check_fits(runner.artifact.max_seq_len)
        self.runner, self.limits, self.on_batch = runner, limits, on_batch
        self._queue: deque[Row] = deque()
        self._waiting = 0  # requests with rows not yet taken by a batch (admission counts these)
        self._lock = threading.Condition()  # guards the queue and the counters; the model thread waits on it
        self._thread: threading.Thread | None = None
        self._tokenize = ThreadPoolExecutor(2, thread_name_prefix="fusionserve-tokenize")

    @property
    def waiting(self) -> int:
        """Requests waiting for the model (not yet taken by a batch), those still being tokenized included."""
        return self._waiting

    def check_room(self) -> None:
        """Raises Overloaded when ``max_queued`` requests already wait, as ``submit`` would: a caller may refuse a
        request this way before it reads or parses it (so a burst's excess costs least)."""
        if self._waiting >= self.limits.max_queued:
            raise Overloaded(f"{self._waiting} requests are waiting for the model; the limit is {self.limits.max_queued}")

    @property
    def queued_rows(self) -> int:
        """Rows tokenized and queued for a batch."""
        with self._lock:
            return len(self._queue)

    async def submit(
        self,
        task: str | Sequence[str],
        inputs: Sequence[TextInput],
        strict: bool = False,
        truncation: str = "right",
        deadline: float | None = None,
        served: Served | None = None,
        options: HeadOptions | None = None,
        max_rows: int | None = None,
    ) -> JobResult:
        """Run ``inputs`` for ``task`` (or for each of several tasks), cut from ``truncation``'s side when too long, on
        ``served`` (default: the runner's latest revision; a batch never mixes revisions), each task's head reading
        ``options``; the inputs must be the shapes the tasks' heads take (``heads.check_input``). ``deadline``
        (``time.monotonic()`` seconds): still waiting then, the request is dropped. Raises Overloaded when
        ``max_queued`` requests already wait, TooManyTokens (``strict``) for inputs over the token limit and
        TooManyRows for more than ``max_rows`` rows, both found while tokenizing, off the event loop,
        DeadlineExceeded, and what the tokenizer or the runner raises for this request's rows; cancelled, it drops
        the rows not yet taken and re-raises."""
        tasks = (task,) if isinstance(task, str) else tuple(task)
        loop = asyncio.get_running_loop()
        with self._lock:
            self.check_room()
            self._waiting += 1  # counted before tokenizing: a burst is refused at once, not after its tokens
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="fusionserve-model", daemon=True)
                self._thread.start()
        job = Job(tasks, len(inputs), loop.create_future(), loop, time.perf_counter(), served or self.runner.served, truncation,
                   options or HeadOptions())  # fmt: skip
        self._tokenize.submit(self._enqueue, job, inputs, strict, max_rows)
        timer = None if deadline is None else loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, job)
        try:
            return await job.future
        except asyncio.CancelledError:
            self._drop(job, started_too=True)  # the caller went away: what is not computed yet never will be
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self, job: Job) -> None:
        """On the loop, at the request's deadline: drop it if no batch has taken a row of it yet."""
        if not job.future.done() and self._drop(job, started_too=False):
            waited_ms = (time.perf_counter() - job.arrived_s) * 1000
            job.future.set_exception(
                DeadlineExceeded(f"the request waited {waited_ms:.0f} ms for the model and passed its deadline")
            )

    def _drop(self, job: Job, started_too: bool) -> bool:
        """Take ``job``'s rows out of the queue (or keep them out), unless a batch took one and not ``started_too``."""
        with self._lock:
            if job.dropped or job.failed:
                return job.dropped
            if job.started_s is not None and not started_too:
                return False
            job.dropped = True
            if not job.enqueued:  # still being tokenized: _enqueue adds nothing, and it counts as waiting no more
                self._waiting -= 1
            elif job.queued:
                self._queue = deque(r for r in self._queue if r.job is not job)
                job.queued = 0
                self._waiting -= 1
            return True

    def _enqueue(self, job: Job, inputs: Sequence[Input], strict: bool, max_rows: int | None) -> None:
        """In a tokenizer thread: the request's rows join the queue, and the model thread is told. Each input is
        tokenized once for the tasks whose heads make the same rows of it; in strict mode a request with an input over
        the token limit fails instead (its length counted here too: a long text never costs the event loop), and a
        request over ``max_rows`` rows fails too."""
        try:
            job.units = self._units(job, inputs, strict)
            rows = sum(len(u.rows) for per_task in job.units for u in per_task)
            if max_rows is not None and rows > max_rows:
                raise TooManyRows(rows, max_rows, [len(u.rows) for u in job.units[0]])
        except Exception as exc:  # a tokenizer failure (or a strict refusal) fails this request only
            with self._lock:
                if job.dropped:  # dropped meanwhile: nobody waits for this answer
                    return
                self._waiting -= 1
                job.failed = True
            refused: list[tuple[asyncio.Future[JobResult], JobResult | BaseException]] = [(job.future, exc)]
            job.loop.call_soon_threadsafe(settle, refused)
            return
        made = [(task, t) for task, per_task in zip(job.tasks, job.units, strict=True) for u in per_task for t in u.rows]
        rows = [Row(job, index, task, t) for index, (task, t) in enumerate(made)]
        job.logits, job.acts = [None] * len(rows), [None] * len(rows)
        job.tokenized_s = time.perf_counter()
        with self._lock:
            if job.dropped:  # its deadline passed, or its caller went away, while it was tokenized
                return
            job.enqueued = True
            job.left = job.queued = len(rows)
            self._queue.extend(rows)
            self._lock.notify()

    def _units(self, job: Job, inputs: Sequence[Input], strict: bool) -> list[list[Unit]]:
        """Per task, per input, its rows; tasks whose heads make the same rows share them (tokenized once)."""
        encoder, made = self.runner.encoder, {}
        out = []
        for task in job.tasks:
            kind = head(job.served.artifact.task(task))
            key = row_key(kind)
            if key not in made:
                made[key] = units(encoder, kind, inputs, job.truncation, job.options)
                bad = next((k for k, u in enumerate(made[key]) if u.error is not None), None)
                if bad is not None:
                    raise InputError(f"inputs[{bad}]: {made[key][bad].error}")
            out.append(made[key])
        if strict:
            over = sorted({i for per_task in out for i, u in enumerate(per_task) if u.truncated})
            if over:
                raise TooManyTokens([(i, *longest(encoder, inputs[i])) for i in over], encoder.max_length)
        return out

    def _work(self) -> None:
        """The model thread: forever, the next batch as soon as there is one, then its results to the loops. It
        must not die (every later request would wait forever): whatever fails fails the batch it happened in."""
        while True:
            rows: list[Row] = []
            try:
                with self._lock:
                    while not self._queue:
                        self._lock.wait()
                    if self.limits.batch_wait_ms and len(self._queue) < self.limits.max_batch_size:
                        self._lock.wait(self.limits.batch_wait_ms / 1000)  # a batch may wait this long to fill
                    rows = self._take()
                if rows:
                    taken = time.perf_counter()
                    logits, acts, span = self._run(rows)
                    self._post(delivered(rows, logits, acts, BatchSpan(taken, *span)))
            except Exception as exc:  # the runner (or the metrics) failed this batch: fail its requests, go on
                self._post(failed(rows, exc))

    def _post(self, settled: list[tuple[Job, JobResult | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[JobResult], JobResult | BaseException]]] = {}
        for job, outcome in settled:
            by_loop.setdefault(job.loop, []).append((job.future, outcome))
        for loop, items in by_loop.items():  # one wake-up per loop and batch
            try:
                loop.call_soon_threadsafe(settle, items)
            except RuntimeError:  # that loop is closed: nobody waits for these answers any more
                continue

    def _take(self) -> list[Row]:
        """The next batch (under the lock): the oldest rows, of any tasks, within the limits, all of one revision (the
        oldest row's: rows of a newer one wait for the next batch)."""
        queue, longest = self._queue, 0
        rows: list[Row] = []
        now = time.perf_counter()
        while queue and len(rows) < self.limits.max_batch_size:
            row = queue[0]
            if rows and row.job.served is not rows[0].job.served:
                break
            width = self.runner.padded_length(max(longest, row.tokens.length))
            if rows and width * (len(rows) + 1) > self.limits.max_batch_tokens:
                break
            queue.popleft()
            self._dequeued(row)
            if row.job.gone:  # its caller went away, or another of its rows failed: nothing to compute
                continue
            longest = max(longest, row.tokens.length)
            rows.append(row)
            if row.job.started_s is None:
                row.job.started_s = now
        return rows

    def _dequeued(self, row: Row) -> None:
        row.job.queued -= 1
        if row.job.queued == 0:
            self._waiting -= 1

    def _run(self, rows: list[Row]) -> tuple[list[np.ndarray], list[np.ndarray | None], tuple]:
        """One model call (in the model thread): per row, its logits and (fusion rows) its activation means; and the
        call's figures for traces (``BatchSpan``'s, from the model's start on)."""
        started = time.perf_counter()
        enc = self.runner.encoder.pad([r.tokens for r in rows])
        tasks = [r.task for r in rows]
        # fusion rows always report their activations
        served = rows[0].job.served
        out = self.runner.run_rows(tasks, enc, return_fusion_activations=True, served=served)
        ran = time.perf_counter()
        acts: list[np.ndarray | None] = []
        for k, a in enumerate(out.fusion_activations):  # a: (layers, seq, task adapters); seq may be its group's width
            if a is None:
                acts.append(None)
                continue
            mask = enc.attention_mask[k : k + 1, : a.shape[1]]  # padding is on the right: the row's tokens all stay
            acts.append(token_means(a[None], mask)[0])  # (layers, task adapters)
        tokens = len(rows) * self.runner.padded_length(enc.input_ids.shape[1])
        if self.on_batch is not None:
            self.on_batch(
                BatchStats(
                    inputs=len(rows), requests=len({id(r.job) for r in rows}), tokens=tokens,
                    model_ms=(time.perf_counter() - started) * 1000, truncated=sum(enc.truncated),
                    tasks=shares(tasks, acts, enc.truncated, {t: served.artifact.tasks[t].adapters for t in set(tasks)}),
                )
            )  # fmt: skip
        span = (started, ran, len(rows), tokens, tuple(dict.fromkeys(tasks)), served.revision)
        return out.logits, acts, span
