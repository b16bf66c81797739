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
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from ..model.artifact import Artifact, TaskEntry
from ..model.predictions import TextInput, label_logits, label_scores
from ..model.runtime import Served
from ..model.tokenize import Encoder
from ..scheduler.batching import DeadlineExceeded, Overloaded, Scheduler, TaskResult, TooManyTokens
from .metrics import Metrics
from .schemas import ClassifyRequest, HTTPError, Limits, describe_json_error, describe_validation_error, timeout_header
from .tracing import TRACE_ID, RequestTrace, Tracer, note_request, trace_id_of

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


def _refusal(exc: HTTPError | Overloaded | TooManyTokens) -> HTTPError:
    if isinstance(exc, Overloaded):
        return HTTPError(503, "overloaded", f"the replica's queue is full: {exc}; retry later")
    if isinstance(exc, TooManyTokens):
        where = ", ".join(f"inputs[{i}] has {n}{'+' if cut else ''}" for i, n, cut in exc.over[:5])
        return HTTPError(413, "too_many_tokens", f"{where} tokens; the limit is {exc.limit} (strict mode)")
    return exc


def answer(
    task: str, entry: TaskEntry, result: TaskResult, truncated: list[bool], with_acts: bool, raw: bool = False
) -> dict[str, Any]:
    """One task's answer as plain data (the JSON body; gRPC copies it into its message); ``raw``: logits, unrounded,
    instead of rounded probabilities."""
    scored = (label_logits if raw else label_scores)(entry.labels, result.logits)
    preds = [
        {"label": label, "score": score, "scores": scores, "truncated": bool(cut)}
        for (label, score, scores), cut in zip(scored, truncated, strict=True)
    ]
    out: dict[str, Any] = {"task": task, "predictions": preds}
    if with_acts and result.activations is not None:
        values = [[[round(v, 6) for v in row] for row in per] for per in result.activations.tolist()]
        out["fusion_activations"] = {"adapters": list(entry.adapters), "values": values}
    return out


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
    ) -> dict[str, Any] | HTTPError:
        """``read`` gets and parses the request (raising HTTPError for what it refuses); ``timeout`` is the
        X-Request-Timeout-Ms header's value, if any, and ``deadline`` a ``time.monotonic()`` instant set by the
        transport (a gRPC call's own deadline); the request's ``timeout_ms`` counts too: the earliest deadline wins,
        the timeouts counted from the moment it arrived. ``check`` sees the revision the request is answered from
        before it is queued (raising HTTPError to refuse it: a protocol's model version). ``traceparent``: the
        caller's W3C trace context, continued by the request's trace (``where`` names its root span). Returns the
        answer (one task's, or ``{"results": [...]}`` for several), or the refusal to send instead. Never raises,
        except CancelledError when the caller goes away (the request's rows not yet computed are dropped, and it is
        counted as dropped): an error of ours becomes a 500 refusal whose id is in the log."""
        trace_id = trace_id_of(traceparent) or (self.tracer.new_trace_id() if self.tracer is not None else None)
        if trace_id is None:
            return await self._classify(read, where, timeout, deadline, check, None)
        TRACE_ID.set(trace_id)  # this request's task: its log lines carry the id
        note_request(trace_id)
        trace = RequestTrace(where, traceparent, trace_id, time.perf_counter())
        outcome = await self._classify(read, where, timeout, deadline, check, trace)
        if self.tracer is not None:
            trace.answered_s = time.perf_counter()
            if isinstance(outcome, HTTPError):
                trace.status, trace.error_type = outcome.status, outcome.reason
            else:
                trace.status = 200
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
            inputs = tuple(TextInput(i) if isinstance(i, str) else TextInput(i.text, i.text_pair) for i in req.inputs)
            self._check(req, inputs, entries)
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
            )
            if trace is not None:
                trace.result = result
            acts, raw = req.return_fusion_activations, req.raw_scores
            answers = [answer(e.name, e, result.tasks[e.name], result.truncated, acts, raw) for e in entries]
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
        except (HTTPError, Overloaded, TooManyTokens) as exc:
            err = _refusal(exc)
            self.stats.observe_rejected(err.reason)
            self.stats.observe_request(task, err.status, time.perf_counter() - started)
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

    def _check(self, req: ClassifyRequest, inputs: tuple[TextInput, ...], entries: list[TaskEntry]) -> None:
        """The limits and what the tasks allow, before anything is queued."""
        rows, limit = len(inputs) * len(entries), self.limits.max_inputs
        if rows > limit:
            what = f"{len(inputs)} inputs" if len(entries) == 1 else f"{len(inputs)} inputs x {len(entries)} tasks = {rows}"
            raise HTTPError(413, "too_many_inputs", f"{what} in one request; the limit is {limit}")
        plain = [e for e in entries if e.kind != "fusion"]
        if req.return_fusion_activations and plain:
            raise HTTPError(
                422,
                "no_fusion",
                f"task '{plain[0].name}' has no fusion layer ({plain[0].kind} task); there are no fusion activations",
            )
