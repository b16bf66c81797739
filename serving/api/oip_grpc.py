"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService`` (serving/api/grpc_predict_v2.proto) beside
``fusionserve.v1.Classifier`` on Serve's gRPC ingress. ``OipGrpc`` holds the service's methods, which Serve calls on
the replica by name (the deployment class inherits them); each request arrives as bytes (``add_servicer`` leaves it
so), is decoded here (bytes that are not the message: INVALID_ARGUMENT, ``malformed_request``), and an inference goes
through the replica's ``Classifier`` like every other request. Refusals: the gRPC codes of ``grpc_ingress``, the
error type in the trailer ``fusionserve-error-type``. Inputs come as ``contents.bytes_contents`` or as
``raw_input_contents``; outputs always go as ``raw_output_contents`` (as Triton answers, and its client reads)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from . import grpc_predict_v2_pb2 as pb
from . import oip
from .auth import UNAUTHORIZED, grpc_authorization
from .grpc_status import call_deadline, refuse
from .schemas import HTTPError
from .tracing import INGRESS_HEADER

SERVICE = "inference.GRPCInferenceService"
_METHODS = {  # method -> (request, response)
    "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
    "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
    "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse),
}
_OPEN = ("ServerLive", "ServerReady")  # probes: no key asked
_DATATYPES = {"TYPE_STRING": pb.TYPE_STRING, "TYPE_FP32": pb.TYPE_FP32}


def add_servicer(servicer: Any, server: Any) -> None:
    """Add the service's methods to ``server``, each request left as bytes (see the module docstring)."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=None, response_serializer=response.SerializeToString
        )
        for name, (_, response) in _METHODS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62
        server.add_registered_method_handlers(SERVICE, handlers)


def _decode(raw: bytes | Message, method: str, limit: int) -> Any:
    kind = _METHODS[method][0]
    if isinstance(raw, kind):
        return raw
    if len(raw) > limit:
        raise HTTPError(413, "body_too_large", f"request message of {len(raw)} bytes; the limit is {limit}")
    try:
        return kind.FromString(raw)
    except DecodeError as exc:
        raise HTTPError(422, "malformed_request", f"the request is not a valid {kind.DESCRIPTOR.full_name}: {exc}") from None


def _param(value: pb.InferParameter) -> Any:
    which = value.WhichOneof("parameter_choice")
    return None if which is None else getattr(value, which)


def read_infer(msg: pb.ModelInferRequest) -> oip.InferCall:
    """An inference request as it arrives over gRPC. Raises HTTPError 400 naming what is wrong."""
    raw = list(msg.raw_input_contents)
    if raw and len(raw) != len(msg.inputs):
        raise oip.bad(f"raw_input_contents holds {len(raw)} entries for {len(msg.inputs)} input(s): one per input")
    tensors = []
    for i, t in enumerate(msg.inputs):
        if raw:
            data = oip.bytes_elements(raw[i], f"input '{t.name}'") if t.datatype == "BYTES" else [raw[i]]
        else:
            data = list(t.contents.bytes_contents)
        if any(d < 0 for d in t.shape):
            raise oip.bad(f"input '{t.name:.60}': shape {list(t.shape)} has a negative dimension")
        tensors.append(oip.Tensor(t.name, t.datatype, tuple(t.shape), data))
    inputs, rank = oip.read_inputs(tensors)
    params = {k: _param(v) for k, v in msg.parameters.items()}
    outputs = [{"name": o.name, "parameters": {k: _param(v) for k, v in o.parameters.items()}} for o in msg.outputs]
    call = oip.InferCall(msg.model_name, msg.model_version, msg.id, oip.request_fields(msg.model_name, inputs, params), rank)
    call.outputs = oip.read_outputs(outputs)
    return call


def infer_response(call: oip.InferCall, version: str, tensors: list[oip.OutTensor]) -> pb.ModelInferResponse:
    out = pb.ModelInferResponse(model_name=call.model, model_version=version, id=call.id)
    for t in tensors:
        out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        out.raw_output_contents.append(t.raw())
    return out


def config_message(config: dict[str, Any]) -> pb.ModelConfig:
    """Triton's JSON model configuration (``oip.model_config``) as the message."""
    out = pb.ModelConfig(name=config["name"], platform=config["platform"], backend=config["backend"],
                         max_batch_size=config["max_batch_size"])  # fmt: skip
    for i in config["input"]:
        out.input.add(name=i["name"], data_type=_DATATYPES[i["data_type"]], dims=i["dims"], optional=i.get("optional", False))
    for o in config["output"]:
        out.output.add(name=o["name"], data_type=_DATATYPES[o["data_type"]], dims=o["dims"])
    for g in config["instance_group"]:
        out.instance_group.add(name=g["name"], count=g["count"], kind=pb.ModelInstanceGroup.Kind.Value(g["kind"]))
    out.dynamic_batching.max_queue_delay_microseconds = config["dynamic_batching"]["max_queue_delay_microseconds"]
    for key, value in config["parameters"].items():
        out.parameters[key].string_value = value["string_value"]
    return out


def metadata_message(meta: dict[str, Any]) -> pb.ModelMetadataResponse:
    out = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
    for where, tensors in ((out.inputs, meta["inputs"]), (out.outputs, meta["outputs"])):
        for t in tensors:
            where.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
    return out


def _metadata(context: Any, key: str) -> str | None:
    for k, v in context.invocation_metadata() if context is not None else ():
        if k == key:
            return v if isinstance(v, str) else v.decode("latin-1")
    return None


class OipGrpc:
    """The service's methods, on the deployment class (``FusionServe``): they use its ``core`` (Classifier),
    ``keys``, ``where`` (replica and node, into the trailer), ``runner``, ``limits``, ``scheduler`` and
    ``ready_problem``."""

    core: Any
    keys: Any
    where: dict[str, str]
    runner: Any
    limits: Any
    scheduler: Any

    async def ready_problem(self) -> str | None:  # the deployment's own, see app.py
        raise NotImplementedError

    async def _answer(self, method: str, raw: Any, context: Any, work: Any, decode: bool = True) -> Any:
        """Ask for the key (all but the probes), decode (unless ``work`` does), run ``work(request)``; a refusal goes
        on ``context``, with an empty answer."""
        try:
            metadata = context.invocation_metadata() if context else ()
            if method not in _OPEN and self.keys is not None and not self.keys.allows(grpc_authorization(metadata)):
                self.core.stats.observe_rejected(UNAUTHORIZED.reason)
                self.core.stats.observe_request("-", UNAUTHORIZED.status, 0.0)
                raise UNAUTHORIZED
            return await work(_decode(raw, method, self.limits.max_body_bytes) if decode else raw)
        except HTTPError as refusal:
            refuse(context, refusal, self.where)
            return _METHODS[method][1]()

    async def ServerLive(self, raw: Any, grpc_context: Any = None) -> Any:
        async def work(_: Any) -> Any:
            return pb.ServerLiveResponse(live=True)

        return await self._answer("ServerLive", raw, grpc_context, work)

    async def ServerReady(self, raw: Any, grpc_context: Any = None) -> Any:
        async def work(_: Any) -> Any:
            return pb.ServerReadyResponse(ready=await self.ready_problem() is None)

        return await self._answer("ServerReady", raw, grpc_context, work)

    async def ServerMetadata(self, raw: Any, grpc_context: Any = None) -> Any:
        async def work(_: Any) -> Any:
            return pb.ServerMetadataResponse(**oip.server_metadata())

        return await self._answer("ServerMetadata", raw, grpc_context, work)

    async def ModelReady(self, raw: Any, grpc_context: Any = None) -> Any:
        async def work(req: Any) -> Any:
            served = self.runner.served
            entry = served.artifact.tasks.get(req.name)  # a task of a head this protocol does not serve: not ready
            ready = entry is not None and oip.serves(entry) and req.version in ("", oip.version_of(served))
            return pb.ModelReadyResponse(ready=ready)

        return await self._answer("ModelReady", raw, grpc_context, work)

    async def ModelMetadata(self, raw: Any, grpc_context: Any = None) -> Any:
        async def work(req: Any) -> Any:
            served = self.runner.served
            return metadata_message(oip.model_metadata(served, oip.model_entry(served, req.name, req.version)))

        return await self._answer("ModelMetadata", raw, grpc_context, work)

    async def ModelConfig(self, raw: Any, grpc_context: Any = None) -> Any:
        async def work(req: Any) -> Any:
            entry = oip.model_entry(self.runner.served, req.name, req.version)
            config = oip.model_config(entry, self.limits.max_inputs, self.scheduler.limits.batch_wait_ms, self.runner.device)
            return pb.ModelConfigResponse(config=config_message(config))

        return await self._answer("ModelConfig", raw, grpc_context, work)

    async def ModelInfer(self, raw: Any, grpc_context: Any = None) -> Any:
        async def work(raw: Any) -> Any:
            held: dict[str, Any] = {}

            async def read() -> Any:  # decoded here: a message too large or not decodable is counted as refused
                held["call"] = call = read_infer(_decode(raw, "ModelInfer", self.limits.max_body_bytes))
                return oip.classify_request(call, self.core.artifact)

            def check(served: Any) -> None:
                held["version"] = oip.version_of(served)
                oip.check_version(held["call"].model, held["call"].version, served)

            outcome = await self.core(read, f"{SERVICE}/ModelInfer", deadline=call_deadline(grpc_context), check=check,
                                      traceparent=_metadata(grpc_context, "traceparent"),
                                      ingress=_metadata(grpc_context, INGRESS_HEADER))  # fmt: skip
            if isinstance(outcome, HTTPError):
                raise outcome
            if grpc_context is not None:
                grpc_context.set_trailing_metadata([(f"fusionserve-{k}", v) for k, v in self.where.items()])
            return infer_response(held["call"], held["version"], oip.output_tensors(held["call"], outcome))

        return await self._answer("ModelInfer", raw, grpc_context, work, decode=False)
