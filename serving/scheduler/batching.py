"""Continuous batching for one replica, with no timer at low load.

A request is tokenized when it arrives (in a tokenizer thread, off the event loop) and its inputs join one queue as
rows — one row per input and task, so a request for several tasks adds each input once per task. One model thread
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
from dataclasses import asdict, dataclass, field

import numpy as np

from fusionserve.errors import FusionServeError

from ..model.activations import token_means
from ..model.predictions import TextInput
from ..model.runtime import OnnxRunner, Served
from ..model.tokenize import Tokens
from ..options import check_ranges, default
from .results import BatchStats, JobResult, TaskResult, shares


class Overloaded(FusionServeError):
    """The replica already holds as many waiting requests as it may; the caller should retry later."""


class DeadlineExceeded(FusionServeError):
    """A request's deadline passed while it waited for the model: it was dropped before the model ran any of it."""


class TooManyTokens(FusionServeError):
    """Strict mode: inputs over the token limit. ``over``: (input index, its tokens, its text was cut first) each."""

    def __init__(self, over: list[tuple[int, int, bool]], limit: int) -> None:
        self.over, self.limit = over, limit
        super().__init__(f"{len(over)} input(s) over the token limit of {limit}")


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


@dataclass(eq=False)
class _Job:
    tasks: tuple[str, ...]
    n: int  # inputs; rows = inputs x tasks, task-major
    future: asyncio.Future[JobResult]
    loop: asyncio.AbstractEventLoop
    arrived_s: float
    served: Served  # the artifact revision it was admitted on, and is answered from
    truncation: str = "right"  # where the tokenizer cuts an input over the token limit
    logits: list[np.ndarray | None] = field(default_factory=list)
    acts: list[np.ndarray | None] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    left: int = 0  # rows not yet computed
    queued: int = 0  # rows not yet taken by a batch
    started_s: float | None = None
    batches: int = 0
    failed: bool = False
    dropped: bool = False  # deadline passed, or caller gone: its rows left the queue (or never joined it)
    enqueued: bool = False  # its rows joined the queue (tokenizing is over)

    def __post_init__(self) -> None:
        rows = self.n * len(self.tasks)
        self.logits, self.acts, self.truncated = [None] * rows, [None] * rows, [False] * self.n
        self.left = self.queued = rows

    @property
    def gone(self) -> bool:
        """Failed, dropped, or its caller went away (the future was cancelled): its rows need no computing."""
        return self.failed or self.dropped or self.future.cancelled()


@dataclass(frozen=True)
class _Row:
    job: _Job
    index: int  # position in its request: task-major, (task k, input i) is k * n + i
    task: str
    tokens: Tokens


class Scheduler:
    """Queues requests' rows and runs them through ``runner`` in batches (see the module docstring). Its model
    thread starts at the first ``submit``. ``on_batch`` is called with every batch's figures, in the model thread."""

    def __init__(self, runner: OnnxRunner, limits: BatchLimits, on_batch: Callable[[BatchStats], None] | None = None) -> None:
        limits.check_fits(runner.artifact.max_seq_len)
        self.runner, self.limits, self.on_batch = runner, limits, on_batch
        self._queue: deque[_Row] = deque()
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
    ) -> JobResult:
        """Classify ``inputs`` for ``task`` (or for each of several tasks), cut from ``truncation``'s side when too
        long, on ``served`` (default: the runner's latest revision; a batch never mixes revisions). ``deadline``
        (``time.monotonic()`` seconds): still waiting then, the request is dropped. Raises Overloaded when
        ``max_queued`` requests already wait, TooManyTokens (``strict``) for inputs over the token limit, found while
        tokenizing, off the event loop, DeadlineExceeded, and what the tokenizer or the runner raises for this
        request's rows; cancelled, it drops the rows not yet taken and re-raises."""
        tasks = (task,) if isinstance(task, str) else tuple(task)
        loop = asyncio.get_running_loop()
        with self._lock:
            self.check_room()
            self._waiting += 1  # counted before tokenizing: a burst is refused at once, not after its tokens
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="fusionserve-model", daemon=True)
                self._thread.start()
        job = _Job(tasks, len(inputs), loop.create_future(), loop, time.perf_counter(), served or self.runner.served, truncation)
        self._tokenize.submit(self._enqueue, job, inputs, strict)
        timer = None if deadline is None else loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, job)
        try:
            return await job.future
        except asyncio.CancelledError:
            self._drop(job, started_too=True)  # the caller went away: what is not computed yet never will be
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self, job: _Job) -> None:
        """On the loop, at the request's deadline: drop it if no batch has taken a row of it yet."""
        if not job.future.done() and self._drop(job, started_too=False):
            waited_ms = (time.perf_counter() - job.arrived_s) * 1000
            job.future.set_exception(
                DeadlineExceeded(f"the request waited {waited_ms:.0f} ms for the model and passed its deadline")
            )

    def _drop(self, job: _Job, started_too: bool) -> bool:
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

    def _enqueue(self, job: _Job, inputs: Sequence[TextInput], strict: bool) -> None:
        """In a tokenizer thread: the request's rows join the queue, and the model thread is told. Each input is
        tokenized once, whatever the number of tasks; in strict mode a request with an input over the token limit
        fails instead (its length counted here too: a long text never costs the event loop)."""
        encoder = self.runner.encoder
        try:
            tokens = encoder.tokens(inputs, job.truncation)
            over = [i for i, t in enumerate(tokens) if t.truncated] if strict else []
            if over:
                picked = [inputs[i] for i in over]
                counts, cut = encoder.count_tokens(picked), encoder.cut(picked)
                raise TooManyTokens(list(zip(over, counts, cut, strict=True)), encoder.max_length)
        except Exception as exc:  # a tokenizer failure (or a strict refusal) fails this request only
            with self._lock:
                if job.dropped:  # dropped meanwhile: nobody waits for this answer
                    return
                self._waiting -= 1
                job.failed = True
            failed: list[tuple[asyncio.Future[JobResult], JobResult | BaseException]] = [(job.future, exc)]
            job.loop.call_soon_threadsafe(_settle, failed)
            return
        rows = [_Row(job, k * job.n + i, task, t) for k, task in enumerate(job.tasks) for i, t in enumerate(tokens)]
        with self._lock:
            if job.dropped:  # its deadline passed, or its caller went away, while it was tokenized
                return
            job.enqueued = True
            self._queue.extend(rows)
            self._lock.notify()

    def _work(self) -> None:
        """The model thread: forever, the next batch as soon as there is one, then its results to the loops. It
        must not die (every later request would wait forever): whatever fails fails the batch it happened in."""
        while True:
            rows: list[_Row] = []
            try:
                with self._lock:
                    while not self._queue:
                        self._lock.wait()
                    if self.limits.batch_wait_ms and len(self._queue) < self.limits.max_batch_size:
                        self._lock.wait(self.limits.batch_wait_ms / 1000)  # a batch may wait this long to fill
                    rows = self._take()
                if rows:
                    logits, acts = self._run(rows)
                    self._post(_delivered(rows, logits, acts))
            except Exception as exc:  # the runner (or the metrics) failed this batch: fail its requests, go on
                self._post(_failed(rows, exc))

    def _post(self, settled: list[tuple[_Job, JobResult | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[JobResult], JobResult | BaseException]]] = {}
        for job, outcome in settled:
            by_loop.setdefault(job.loop, []).append((job.future, outcome))
        for loop, items in by_loop.items():  # one wake-up per loop and batch
            try:
                loop.call_soon_threadsafe(_settle, items)
            except RuntimeError:  # that loop is closed: nobody waits for these answers any more
                continue

    def _take(self) -> list[_Row]:
        """The next batch (under the lock): the oldest rows, of any tasks, within the limits, all of one revision (the
        oldest row's: rows of a newer one wait for the next batch)."""
        queue, longest = self._queue, 0
        rows: list[_Row] = []
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

    def _dequeued(self, row: _Row) -> None:
        row.job.queued -= 1
        if row.job.queued == 0:
            self._waiting -= 1

    def _run(self, rows: list[_Row]) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """One model call (in the model thread): per row, its logits and (fusion rows) its activation means."""
        started = time.perf_counter()
        enc = self.runner.encoder.pad([r.tokens for r in rows])
        tasks = [r.task for r in rows]
        # fusion rows always report their activations
        served = rows[0].job.served
        out = self.runner.run_rows(tasks, enc, return_fusion_activations=True, served=served)
        acts: list[np.ndarray | None] = []
        for k, a in enumerate(out.fusion_activations):  # a: (layers, seq, task adapters); seq may be its group's width
            if a is None:
                acts.append(None)
                continue
            mask = enc.attention_mask[k : k + 1, : a.shape[1]]  # padding is on the right: the row's tokens all stay
            acts.append(token_means(a[None], mask)[0])  # (layers, task adapters)
        if self.on_batch is not None:
            self.on_batch(
                BatchStats(
                    inputs=len(rows), requests=len({id(r.job) for r in rows}),
                    tokens=len(rows) * self.runner.padded_length(enc.input_ids.shape[1]),
                    model_ms=(time.perf_counter() - started) * 1000, truncated=sum(enc.truncated),
                    tasks=shares(tasks, acts, enc.truncated, {t: served.artifact.tasks[t].adapters for t in set(tasks)}),
                )
            )  # fmt: skip
        return out.logits, acts


def _delivered(
    rows: list[_Row], logits: list[np.ndarray], acts: list[np.ndarray | None]
) -> list[tuple[_Job, JobResult | BaseException]]:
    """Record a batch's rows in their requests; the requests it completed, with their results."""
    for job in {id(r.job): r.job for r in rows}.values():
        job.batches += 1
    done: list[tuple[_Job, JobResult | BaseException]] = []
    for k, row in enumerate(rows):
        job = row.job
        job.logits[row.index], job.acts[row.index] = logits[k], acts[k]
        job.truncated[row.index % job.n] = row.tokens.truncated
        job.left -= 1
        if job.left == 0 and not job.gone:
            done.append((job, _result(job)))
    return done


def _failed(rows: list[_Row], exc: Exception) -> list[tuple[_Job, JobResult | BaseException]]:
    jobs = {id(r.job): r.job for r in rows if not r.job.gone}
    for job in jobs.values():
        job.failed = True
    return [(job, exc) for job in jobs.values()]


def _settle(items: list[tuple[asyncio.Future[JobResult], JobResult | BaseException]]) -> None:
    """On the event loop: hand each waiting request its result or its error."""
    for future, outcome in items:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _result(job: _Job) -> JobResult:
    tasks = {}
    for k, task in enumerate(job.tasks):
        rows = range(k * job.n, (k + 1) * job.n)
        logits = np.stack([job.logits[i] for i in rows])  # type: ignore[misc]
        acts = None if job.acts[rows[0]] is None else np.stack([job.acts[i] for i in rows])  # type: ignore[misc]
        tasks[task] = TaskResult(logits, acts)
    started = job.started_s if job.started_s is not None else job.arrived_s
    return JobResult(tasks, list(job.truncated), (started - job.arrived_s) * 1000, job.batches)
