"""How a refusal is told over gRPC, for every service on Serve's gRPC ingress (``fusionserve.v1.Classifier`` in
``grpc_ingress.py``, the Open Inference Protocol's ``inference.GRPCInferenceService`` in ``oip_grpc.py``): the HTTP
status of the refusal becomes a gRPC code, its error type rides in the trailing metadata ``fusionserve-error-type``,
and the replica and node that answered in ``fusionserve-replica`` / ``fusionserve-node``."""

from __future__ import annotations

from typing import Any

import grpc

from .schemas import HTTPError

# the HTTP status of a refusal -> its gRPC code: the caller's mistakes are INVALID_ARGUMENT whatever the HTTP side
# calls them (the type in the trailer tells them apart), a missing task NOT_FOUND, overload UNAVAILABLE (retry)
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
ERROR_TYPE_KEY = "fusionserve-error-type"
CALL_DEADLINE = "_fusionserve_call_deadline"  # the gRPC call's deadline (time.monotonic()), see record_call_deadlines
# a call still queued this long before its own deadline is dropped and answered DEADLINE_EXCEEDED by us, before gRPC
# cancels it at the deadline (which would count it as a caller gone): no queued request is answered within it
CALL_DEADLINE_MARGIN_S = 0.02


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC code of a refusal with HTTP ``status`` (anything unlisted is INTERNAL)."""
    return STATUS_CODES.get(status, grpc.StatusCode.INTERNAL)


def call_deadline(context: Any) -> float | None:
    """The instant (``time.monotonic()``) by which a queued call is dropped: its own deadline less the margin."""
    deadline = getattr(context, CALL_DEADLINE, None)
    return None if deadline is None else deadline - CALL_DEADLINE_MARGIN_S


def refuse(context: Any, refusal: HTTPError, where: dict[str, str]) -> None:
    """Set ``refusal``'s code, details and trailer on ``context`` (Serve sends them once the method returns)."""
    if context is not None:
        context.set_code(grpc_code(refusal.status))
        context.set_details(refusal.message)
        context.set_trailing_metadata([(ERROR_TYPE_KEY, refusal.reason), *((f"fusionserve-{k}", v) for k, v in where.items())])
