"""One classify call, whatever protocol carried it: parse -> validate -> task lookup -> limits -> the scheduler ->
the answer (for one ``task``, or for several ``tasks`` in one call). The HTTP routes (``app.py``) and the gRPC method (``grpc_ingress.py``) both call ``Classifier``; each
only reads its request and writes the outcome in its own protocol, so a request is refused for the same reasons,
with the same message, over either. A refusal is an ``HTTPError`` (status, type, message): gRPC maps the status to
its own codes. No HTTP framework, no Ray here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import ValidationError

from fusionserve.errors import InputError

from ..model import heads
from ..model.artifact import Artifact, TaskEntry
from ..model.heads import HeadOptions
from ..model.predictions import ChoiceInput, Input, TextInput, read_input
from ..model.runtime import Served
from ..model.tokenize import Encoder
from ..options import MAX_CHOICES
from ..scheduler.batching import DeadlineExceeded, Overloaded, Scheduler, TooManyRows, TooManyTokens
from ..scheduler.results import JobResult, TaskResult
from .metrics import Metrics
from .schemas import ClassifyRequest, HTTPError, Limits, describe_json_error, describe_validation_error, timeout_header
from .tracing import EDGE, TRACE_ID, RequestTrace, Tracer, note_request, trace_id_of

_NAMED = 5  # unknown task names an error names, at most
log = logging.getLogger("ray.serve").getChild("fusionserve")  # in the replica log files, with Serve's own


def log_unexpected(where: str, exc: BaseException) -> str:
    """Log an error of ours with a fresh id; returns the message for the caller, which names that id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("unexpected error %s in %s", error_id, where, exc_info=exc)
    return f"unexpected server error (id {error_id}, also in the server log); the request was not processed"


def parse_json(body: bytes) -> ClassifyRequest:
    """A JSON body, parsed and validated in one pass; a body that is not JSON is ``malformed_json``."""
    try:
        return ClassifyRequest.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def parse_fields(fields: dict[str, Any]) -> ClassifyRequest:
    """A request already decoded by its protocol (gRPC), validated by the same model as a JSON body."""
    try:
        return ClassifyRequest.model_validate(fields)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> HTTPError:
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        return HTTPError(422, "malformed_json", describe_json_error(errors[0]["msg"]))
    return HTTPError(422, "invalid_request", describe_validation_error(exc))


def _refusal(exc: HTTPError | Overloaded | TooManyTokens | TooManyRows | InputError) -> HTTPError:
    if isinstance(exc, InputError):  # found while its rows were made (a question longer than a window holds)
        return HTTPError(422, "invalid_input", str(exc))
    if isinstance(exc, Overloaded):
        return HTTPError(503, "overloaded", f"the replica's queue is full: {exc}; retry later")
    if isinstance(exc, TooManyRows):
        many = ", ".join(f"inputs[{i}] makes {n}" for i, n in enumerate(exc.rows) if n > 1)
        return HTTPError(
            413, "too_many_inputs", f"the request makes {exc.total} rows ({many or 'one per input'}; a choice or a window "
            f"of a long context is a row); the limit is {exc.limit}",
        )  # fmt: skip
    if isinstance(exc, TooManyTokens):
        where = ", ".join(f"inputs[{i}] has {n}{'+' if cut else ''}" for i, n, cut in exc.over[:5])
        return HTTPError(413, "too_many_tokens", f"{where} tokens; the limit is {exc.limit} (strict mode)")
    return exc


def answer(
    entry: TaskEntry,
    inputs: Sequence[Input],
    result: TaskResult,
    with_acts: bool,
    raw: bool = False,
    options: HeadOptions | None = None,
) -> dict[str, Any]:
    """One task's answer as plain data (the JSON body; gRPC copies it into its message), each prediction shaped by the
    task's head (``heads.answer``); ``raw``: logits, unrounded, instead of rounded probabilities."""
    options = options or HeadOptions()
    preds = [
        heads.answer(entry, inp, unit, outputs, options, raw)
        for inp, unit, outputs in zip(inputs, result.units, result.outputs, strict=True)
    ]
    out: dict[str, Any] = {"task": entry.name, "predictions": preds}
    if with_acts and result.activations is not None:
        values = [[[round(v, 6) for v in row] for row in per] for per in result.activations.tolist()]
        out["fusion_activations"] = {"adapters": list(entry.adapters), "values": values}
    return out


def describe_tasks(artifact: Artifact, limits: Limits) -> dict[str, Any]:
    """GET /v1/tasks: every task with its head (kind, labels, the input it takes, the options it reads), the limits,
    and (a live artifact) the revision served."""
    tasks = {}
    for name, t in artifact.tasks.items():
        kind = heads.head(t)
        about: dict[str, Any] = {"kind": t.kind, "head": kind, "labels": list(t.labels), "adapters": list(t.adapters)}
        about["input"] = list(heads.INPUT_FIELDS[kind])
        about["options"] = list(heads.OPTIONS_READ.get(kind, ()))
        if getattr(t, "num_choices", None):  # the count AdapterHub trained with: information, not a limit
            about["num_choices"] = t.num_choices
        tasks[name] = about
    return {
        "revision": artifact.revision,
        "max_seq_len": artifact.max_seq_len,
        "max_inputs_per_request": limits.max_inputs,
        "max_choices": MAX_CHOICES,
        "tasks": tasks,
    }


class Classifier:
    """The replica's classify path behind every ingress; records each call in the metrics, and in a trace when the
    replica has a ``tracer`` (serving/api/tracing.py)."""

    def __init__(
        self, encoder: Encoder, scheduler: Scheduler, limits: Limits, stats: Metrics, tracer: Tracer | None = None
    ) -> None:
        self.encoder, self.scheduler, self.limits, self.stats, self.tracer = encoder, scheduler, limits, stats, tracer

    @property
    def artifact(self) -> Artifact:
        """The artifact at the revision served now (a live artifact's tasks change with it)."""
        return self.scheduler.runner.artifact

    async def __call__(
        self,
        read: Callable[[], Awaitable[ClassifyRequest]],
        where: str,
        timeout: str | None = None,
        deadline: float | None = None,
        check: Callable[[Served], None] | None = None,
        traceparent: str | None = None,
        answered_as: Callable[[int], int] = int,
        ingress: str | None = None,
    ) -> dict[str, Any] | HTTPError:
        """``read`` gets and parses the request (raising HTTPError for what it refuses); ``timeout`` is the
        X-Request-Timeout-Ms header's value, if any, and ``deadline`` a ``time.monotonic()`` instant set by the
        transport (a gRPC call's own deadline); the request's ``timeout_ms`` counts too: the earliest deadline wins,
        the timeouts counted from the moment it arrived. ``check`` sees the revision the request is answered from
        before it is queued (raising HTTPError to refuse it: a protocol's model version). ``traceparent``: the
        caller's W3C trace context, continued by the request's trace (``where`` names its root span). ``answered_as``:
        the status a refusal's HTTP status is answered with by the protocol (the Open Inference Protocol's 400 for
        422), which the metrics and the trace record. ``ingress``: HAProxy's stamp of a gRPC call (its metadata; over
        HTTP, ``tracing.TraceEdge`` read it and hands the trace on once the answer is sent). Returns the
        answer (one task's, or ``{"results": [...]}`` for several), or the refusal to send instead. Never raises,
        except CancelledError when the caller goes away (the request's rows not yet computed are dropped, and it is
        counted as dropped): an error of ours becomes a 500 refusal whose id is in the log."""
        trace_id = trace_id_of(traceparent) or (self.tracer.new_trace_id() if self.tracer is not None else None)
        if trace_id is None:
            return await self._classify(read, where, timeout, deadline, check, None, answered_as)
        TRACE_ID.set(trace_id)  # this request's task: its log lines carry the id
        note_request(trace_id)
        edge = (EDGE.get() or self.tracer.edge(ingress)) if self.tracer is not None else None
        trace = RequestTrace(where, traceparent, trace_id, time.perf_counter())
        if edge is not None:
            trace.reached_s, trace.ingress_s = edge.reached_s, edge.ingress_s
        outcome = await self._classify(read, where, timeout, deadline, check, trace, answered_as)
        if self.tracer is not None and edge is not None:
            trace.answered_s = time.perf_counter()
            if isinstance(outcome, HTTPError):
                trace.status, trace.error_type = answered_as(outcome.status), outcome.reason
            else:
                trace.status = 200
            if edge.records:  # recorded by the edge once the answer is sent
                edge.trace = trace
            else:
                self.tracer.record(trace)
        return outcome

    async def _classify(
        self,
        read: Callable[[], Awaitable[ClassifyRequest]],
        where: str,
        timeout: str | None,
        deadline: float | None,
        check: Callable[[Served], None] | None,
        trace: RequestTrace | None,
        answered_as: Callable[[int], int] = int,
    ) -> dict[str, Any] | HTTPError:
        started, arrived = time.perf_counter(), time.monotonic()
        task = "-"  # only known task names become metric labels
        try:
            self.scheduler.check_room()  # before the body is read or parsed: a burst's excess costs least
            limits_ms = [t for t in (timeout_header(timeout),) if t is not None]
            req = await read()
            served = self.scheduler.runner.served  # the revision this request is checked against and answered from
            if check is not None:
                check(served)
            entries = self._tasks(req.task_names, served.artifact)
            task = req.task_names[0] if req.task is not None else "multi"
            inputs, options = self._check(req, entries)
            if req.timeout_ms is not None:
                limits_ms.append(req.timeout_ms)
            deadline = min([d for d in (deadline,) if d is not None] + [arrived + ms / 1000 for ms in limits_ms], default=None)
            if trace is not None:
                trace.parsed_s, trace.task, trace.inputs = time.perf_counter(), task, len(inputs)
            result = await self.scheduler.submit(
                req.task_names,
                inputs,
                strict=req.strict,
                truncation=req.truncation_direction,
                deadline=deadline,
                served=served,
                options=options,
                max_rows=self.limits.max_inputs,
            )
            if trace is not None:
                trace.result = result
            answers = await _answers(req, entries, inputs, result, options)
            self.stats.observe_request(task, 200, time.perf_counter() - started, result.queue_ms)
            return answers[0] if req.task is not None else {"results": answers}
        except DeadlineExceeded as exc:
            self.stats.observe_dropped("deadline_exceeded")
            self.stats.observe_request(task, 504, time.perf_counter() - started)
            return HTTPError(504, "deadline_exceeded", f"{exc}; it was not run")
        except asyncio.CancelledError:  # the caller went away (Serve cancels the handler): counted apart, not as 200
            self.stats.observe_dropped("client_disconnected")
            self.stats.observe_request(task, 499, time.perf_counter() - started)
            raise
        except (HTTPError, Overloaded, TooManyTokens, TooManyRows, InputError) as exc:
            err = _refusal(exc)
            self.stats.observe_rejected(err.reason)
            self.stats.observe_request(task, answered_as(err.status), time.perf_counter() - started)
            return err
        except Exception as exc:  # a bug or a runtime failure: never a bare failure, always an id to find it in the log
            self.stats.observe_request(task, 500, time.perf_counter() - started)
            return HTTPError(500, "internal", log_unexpected(where, exc))

    def _tasks(self, names: list[str], artifact: Artifact) -> list[TaskEntry]:
        unknown = [t for t in names if t not in artifact.tasks]
        if unknown:
            shown = ", ".join(map(repr, unknown[:_NAMED]))
            what = f"unknown task {shown}" if len(unknown) == 1 else f"unknown tasks {shown}"
            if len(unknown) > _NAMED:
                what += f" and {len(unknown) - _NAMED} more"
            raise HTTPError(404, "unknown_task", f"{what}; known tasks: {', '.join(artifact.tasks)}")
        return [artifact.tasks[t] for t in names]

    def _check(self, req: ClassifyRequest, entries: list[TaskEntry]) -> tuple[tuple[Input, ...], HeadOptions]:
        """The limits and what the tasks allow, before anything is queued: the inputs and the heads' options, read.
        A request's rows are its inputs x tasks, a choice and a window each one row: counted here as far as they
        are known before tokenizing (a question-answering input as one row; its windows, once cut, by the scheduler)."""
        inputs = tuple(_read_input(i, k) for k, i in enumerate(req.inputs))
        per_input = [len(i.choices) if isinstance(i, ChoiceInput) else 1 for i in inputs]
        rows, limit = sum(per_input) * len(entries), self.limits.max_inputs
        if rows > limit:
            what = f"{len(inputs)} inputs" if len(entries) == 1 else f"{len(inputs)} inputs x {len(entries)} tasks"
            if rows != len(inputs) * len(entries):
                what += f" making {rows} rows (a choice is a row)"
            elif len(entries) > 1:
                what += f" = {rows}"
            raise HTTPError(413, "too_many_inputs", f"{what} in one request; the limit is {limit}")
        for k, inp in enumerate(inputs):
            for e in entries:
                try:
                    heads.check_input(e, inp)
                except InputError as exc:
                    raise HTTPError(422, "invalid_input", f"inputs[{k}]: {exc}") from None
        try:
            options = req.head_options()
            options.check(entries, req.raw_scores, self.encoder.max_length)
        except InputError as exc:
            raise HTTPError(422, "invalid_option", str(exc)) from None
        plain = [e for e in entries if e.kind != "fusion"]
        if req.return_fusion_activations and plain:
            raise HTTPError(
                422,
                "no_fusion",
                f"task '{plain[0].name}' has no fusion layer ({plain[0].kind} task); there are no fusion activations",
            )
        return inputs, options


async def _answers(
    req: ClassifyRequest, entries: list[TaskEntry], inputs: Sequence[Input], result: JobResult, options: HeadOptions
) -> list[dict[str, Any]]:
    """Every task's answer. A token-level head's (word pieces, entities, spans over windows) is Python work per token:
    made off the event loop, which goes on taking requests meanwhile; a sequence-level one costs less than the hop."""

    def make() -> list[dict[str, Any]]:
        return [answer(e, inputs, result.tasks[e.name], req.return_fusion_activations, req.raw_scores, options) for e in entries]

    if any(e.level == "token" for e in entries):
        return await asyncio.get_running_loop().run_in_executor(None, make)
    return make()


def _read_input(item: Any, k: int) -> Input:
    """A validated request input (a text, or one of the objects) as the input its head reads; raises HTTPError 422
    ``invalid_input`` naming it and what is wrong."""
    try:
        return TextInput(item) if isinstance(item, str) else read_input(item.model_dump(exclude_none=True))
    except InputError as exc:
        raise HTTPError(422, "invalid_input", f"inputs[{k}]: {exc}") from None
