"""Classify over gRPC (Ray Serve's gRPC ingress, serving/api/fusionserve.proto): the message is turned into the same
request model a JSON body is validated with and goes through the same ``Classifier``; a refusal becomes a gRPC
status code, with the HTTP API's error type in the trailing metadata ``fusionserve-error-type``.

Serve calls the replica's ``Classify`` method with the request and a ``grpc_context`` (Serve's RayServegRPCContext:
code, details and trailing metadata are sent once the method returns). ``add_servicer`` (the servicer function Serve's
``grpc_options`` name) leaves the request as bytes, so a message that does not decode (bad UTF-8, garbage, cut short)
is refused here like a body that is not JSON (INVALID_ARGUMENT, ``malformed_request``, counted), not by gRPC's own
deserializer as UNKNOWN. A message over the size limit is refused by gRPC as it arrives (``transport_env``).
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from .. import private
from ..model.heads import QA_OPTIONS
from ..private import GRPC_MESSAGE_SIZE_ENV, serve_env
from . import fusionserve_pb2 as pb
from . import oip_grpc
from .auth import UNAUTHORIZED, KeyCheck, grpc_authorization
from .classify import Classifier, parse_fields
from .grpc_status import CALL_DEADLINE, ERROR_TYPE_KEY, STATUS_CODES, call_deadline, grpc_code, refuse
from .schemas import ClassifyRequest, HTTPError
from .tracing import INGRESS_HEADER

METHOD = "/fusionserve.v1.Classifier/Classify"
__all__ = [
    "CALL_DEADLINE",
    "ERROR_TYPE_KEY",
    "STATUS_CODES",
    "add_servicer",
    "classify_grpc",
    "grpc_code",
    "record_call_deadlines",
]
SERVICE = "fusionserve.v1.Classifier"
TRANSPORT_FLOOR_BYTES = 4 * 1024 * 1024  # gRPC's own default: room for the answers, which share the limit


def transport_env(max_body_bytes: int) -> dict[str, str]:
    """The environment that caps the gRPC messages Serve's servers (a replica's, the proxy's) accept: gRPC refuses a
    larger one (RESOURCE_EXHAUSTED) from its length prefix, before reading it (Serve's default is 2 GiB: a 300 MB
    message was read whole into the replica). Messages over ``max_body_bytes`` but under the cap are refused by
    ``classify_grpc`` (INVALID_ARGUMENT, ``body_too_large``); the cap is never under 4 MiB, as Serve uses the same
    setting for the answers it sends."""
    return serve_env({GRPC_MESSAGE_SIZE_ENV: max(max_body_bytes, TRANSPORT_FLOOR_BYTES)})


def add_servicer(servicer: Any, server: Any) -> None:
    """Add ``Classify`` to ``server`` with the request left as bytes (see the module docstring); what the generated
    ``add_ClassifierServicer_to_server`` does otherwise. The Open Inference Protocol's service goes beside it
    (``oip_grpc.add_servicer``): one servicer function for both, the one Serve configs name."""
    handlers = {
        "Classify": grpc.unary_unary_rpc_method_handler(
            servicer.Classify, request_deserializer=None, response_serializer=pb.ClassifyResponse.SerializeToString
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62
        server.add_registered_method_handlers(SERVICE, handlers)
    oip_grpc.add_servicer(servicer, server)


def _input(i: pb.Input) -> Any:
    """One input message as a JSON body's input: a question-answering object when it has a question or a context, a
    multiple-choice one when it has choices, a pair, or a plain text (a field the shape does not have, when set, is
    passed on and refused by name, as over HTTP)."""
    if i.HasField("question") or i.HasField("context"):
        qa = {k: getattr(i, k) for k in ("question", "context", "text_pair") if i.HasField(k)}
        return qa | ({"text": i.text} if i.text else {}) | ({"choices": list(i.choices)} if i.choices else {})
    if i.choices:
        return {"text": i.text, "choices": list(i.choices)} | ({"text_pair": i.text_pair} if i.HasField("text_pair") else {})
    return {"text": i.text, "text_pair": i.text_pair} if i.HasField("text_pair") else i.text


def request_fields(msg: pb.ClassifyRequest) -> dict[str, Any]:
    """The message as the fields of a JSON body: an input without a pair is a plain text; an empty ``task`` or
    ``tasks`` is left out, as a JSON body would leave it out (giving neither, or both, is refused as over HTTP)."""
    fields: dict[str, Any] = {"inputs": [_input(i) for i in msg.inputs], "return_fusion_activations": msg.return_fusion_activations,
                              "strict": msg.strict, "raw_scores": msg.raw_scores}  # fmt: skip
    if msg.truncation_direction:
        fields["truncation_direction"] = msg.truncation_direction
    for name in ("timeout_ms", "aggregation_strategy", *QA_OPTIONS):
        if msg.HasField(name):
            fields[name] = getattr(msg, name)
    if msg.task:
        fields["task"] = msg.task
    if msg.tasks:
        fields["tasks"] = list(msg.tasks)
    return fields


def _labels(preds: list[Any]) -> tuple[str, ...]:
    """The labels the answer's scores are keyed by, in the task's order (a classification prediction's scores, or with
    raw_scores a tagged token's); none for the heads whose scores are not per label."""
    for p in preds[:1]:
        if isinstance(p, dict) and isinstance(p.get("scores"), dict):
            return tuple(p["scores"])
        tokens = p.get("tokens") if isinstance(p, dict) else None
        if tokens and "scores" in tokens[0]:
            return tuple(tokens[0]["scores"])
    return ()


def _prediction(p: Any, labels: tuple[str, ...]) -> pb.Prediction:
    """One prediction (``heads.answer``'s data, a list of answers for top_k > 1) as the message."""
    if isinstance(p, list) or "answer" in p:
        return pb.Prediction(answers=[pb.Answer(**a) for a in (p if isinstance(p, list) else [p])])
    out = pb.Prediction(truncated=p["truncated"], score=p.get("score", 0.0), label=p.get("label", ""), choice=p.get("choice", 0))
    scores = p.get("scores")
    out.scores.extend([scores[lab] for lab in labels] if isinstance(scores, dict) else scores or [])
    for t in p.get("tokens") or ():
        out.tokens.add(
            **{k: v for k, v in t.items() if k != "scores"}, scores=[t["scores"][lab] for lab in labels] if "scores" in t else []
        )
    for e in p.get("entities") or ():
        out.entities.add(**e)
    return out


def _fill(out: pb.ClassifyResponse | pb.TaskAnswer, answer: dict[str, Any]) -> None:
    """One task's answer (classify.answer's data) into ``out``. The labels are the answer's own (the keys of its
    scores, in the task's order): a lookup in the revision served after the answer could miss a task removed or
    replaced meanwhile."""
    preds = answer["predictions"]
    labels = _labels(preds)
    out.task = answer["task"]
    out.labels.extend(labels)
    out.predictions.extend(_prediction(p, labels) for p in preds)
    acts = answer.get("fusion_activations")
    if acts is not None:
        values = acts["values"]  # per input, per layer, per adapter
        flat = [v for per_input in values for layer in per_input for v in layer]
        out.fusion_activations.CopyFrom(
            pb.FusionActivations(adapters=acts["adapters"], layers=len(values[0]) if values else 0, values=flat)
        )


def response_message(answer: dict[str, Any]) -> pb.ClassifyResponse:
    """The answer (one task's, or ``{"results": [...]}``) as the proto message."""
    out = pb.ClassifyResponse()
    if "results" in answer:
        for one in answer["results"]:
            _fill(out.results.add(), one)
    else:
        _fill(out, answer)
    return out


def decode(raw: bytes | pb.ClassifyRequest) -> pb.ClassifyRequest:
    """The request message from its bytes (a servicer that decodes it itself hands the message). Raises HTTPError
    ``malformed_request`` for bytes that are not a ClassifyRequest."""
    if isinstance(raw, pb.ClassifyRequest):
        return raw
    try:
        return pb.ClassifyRequest.FromString(raw)
    except DecodeError as exc:
        raise HTTPError(422, "malformed_request", f"the request is not a valid fusionserve.v1.ClassifyRequest: {exc}") from None


async def classify_grpc(
    core: Classifier, raw: bytes | pb.ClassifyRequest, context: Any, where: dict[str, str], keys: KeyCheck | None = None
) -> pb.ClassifyResponse:
    """One ``Classify`` call on ``core``; a refusal sets the code, details and trailer on ``context`` and answers an
    empty message (gRPC sends only the status then). ``where`` (replica, node) goes into the trailer as well. With
    ``keys``, a call whose ``authorization`` metadata carries none of them is refused UNAUTHENTICATED first."""
    limit = core.limits.max_body_bytes
    if keys is not None and not keys.allows(grpc_authorization(context.invocation_metadata() if context else ())):
        core.stats.observe_rejected(UNAUTHORIZED.reason)
        core.stats.observe_request("-", UNAUTHORIZED.status, 0.0)
        refuse(context, UNAUTHORIZED, where)
        return pb.ClassifyResponse()

    async def read() -> ClassifyRequest:
        size = len(raw) if isinstance(raw, bytes) else raw.ByteSize()
        if size > limit:  # the same limit as an HTTP body's
            raise HTTPError(413, "body_too_large", f"request message of {size} bytes; the limit is {limit}")
        return parse_fields(request_fields(decode(raw)))

    metadata = list(context.invocation_metadata()) if context else []
    traceparent, stamp = (next((v for k, v in metadata if k == name), None) for name in ("traceparent", INGRESS_HEADER))
    outcome = await core(read, METHOD, deadline=call_deadline(context), traceparent=traceparent, ingress=stamp)
    if isinstance(outcome, HTTPError):
        refuse(context, outcome, where)
        return pb.ClassifyResponse()
    if context is not None:
        context.set_trailing_metadata([(f"fusionserve-{k}", v) for k, v in where.items()])
    return response_message(outcome)


def record_call_deadlines() -> None:
    """In a replica: keep each gRPC call's own deadline on the context Serve hands ``Classify``, as ``CALL_DEADLINE``
    (``private.record_call_deadlines``: Serve's context does not carry it)."""
    private.record_call_deadlines(CALL_DEADLINE)
