"""Runs in the tritonclient environment (tests/triton_env.py), not in fusionserve's: one JSON request a line on stdin,
one JSON answer a line on stdout, until stdin closes. Imports nothing of fusionserve.

Requests: ``{"op": "call", "client": "http"|"grpc"|"http_aio"|"grpc_aio", "url", "method", "args", "kwargs"}``
(any client method; protobuf answers as dicts) and ``{"op": "infer", "client", "url", "model", "version", "texts",
"pairs", "rank", "binary", "outputs": [{"name", "class_count", "binary"}], "parameters", "headers",
"client_timeout"}``: ``{"outputs": {name: values}, "response": ...}``. A tritonclient error answers
``{"error": message, "status": str}``.
"""

import asyncio
import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from tritonclient.utils import InferenceServerException

MODULES = {"http": httpclient, "grpc": grpcclient, "http_aio": httpaio, "grpc_aio": grpcaio}
LOOP = asyncio.new_event_loop()
_clients = {}


def plain(value):
    if isinstance(value, Message):
        return MessageToDict(value, preserving_proto_field_name=True)
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def client(kind, url):
    if (kind, url) not in _clients:

        async def make():  # the asyncio clients bind to the running loop
            return MODULES[kind].InferenceServerClient(url)

        _clients[kind, url] = (
            LOOP.run_until_complete(make()) if kind.endswith("aio") else MODULES[kind].InferenceServerClient(url)
        )
    return _clients[kind, url]


def run(result):
    return LOOP.run_until_complete(result) if asyncio.iscoroutine(result) else result


def infer(req):
    module = MODULES[req["client"]]
    rank = req.get("rank", 2)
    inputs = []
    for name, texts in (("text", req["texts"]), ("text_pair", req.get("pairs"))):
        if texts is None:
            continue
        data = np.array([[t] for t in texts] if rank == 2 else texts, dtype=object)
        tensor = module.InferInput(name, list(data.shape), "BYTES")
        if req["client"].startswith("http"):
            tensor.set_data_from_numpy(data, binary_data=req.get("binary", True))
        else:
            tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    outputs = None
    if req.get("outputs") is not None:
        outputs = []
        for o in req["outputs"]:
            if req["client"].startswith("http"):
                outputs.append(
                    module.InferRequestedOutput(o["name"], binary_data=o.get("binary", True), class_count=o.get("class_count", 0))
                )
            else:
                outputs.append(module.InferRequestedOutput(o["name"], class_count=o.get("class_count", 0)))
    kwargs = {
        "model_version": req.get("version", ""),
        "outputs": outputs,
        "headers": req.get("headers"),
        "parameters": req.get("parameters"),
    }
    if req.get("timeout_us") is not None:
        kwargs["timeout"] = req["timeout_us"]
    if req.get("client_timeout") is not None and req["client"].startswith("grpc"):
        kwargs["client_timeout"] = req["client_timeout"]
    result = run(client(req["client"], req["url"]).infer(req["model"], inputs, **kwargs))
    names = [o["name"] for o in req["outputs"]] if req.get("outputs") is not None else ["label", "scores"]
    response = result.get_response()
    return {"outputs": {n: plain(result.as_numpy(n)) for n in names}, "response": plain(response)}


def answer(req):
    try:
        if req["op"] == "infer":
            return infer(req)
        method = getattr(client(req["client"], req["url"]), req["method"])
        return {"result": plain(run(method(*req.get("args", []), **req.get("kwargs", {}))))}
    except InferenceServerException as exc:
        return {"error": exc.message(), "status": str(exc.status())}
    except Exception as exc:  # the worker goes on: the test reads what failed
        return {"error": f"{type(exc).__name__}: {exc}", "status": "worker"}


for line in sys.stdin:
    print(json.dumps(answer(json.loads(line))), flush=True)
