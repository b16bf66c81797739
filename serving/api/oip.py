"""The Open Inference Protocol (KServe's "v2" protocol, as Triton speaks it) as plain data, whatever carries it: an
inference request read into the same ``ClassifyRequest`` a JSON body of POST /v1/classify is validated with (so it
is refused for the same reasons, with the same messages), and the classify answer written back as output tensors.
The HTTP routes (``oip_http.py``) and the gRPC service (``oip_grpc.py``) read and write their own encodings of it;
everything between goes through ``Classifier`` like any other request. No HTTP framework, no Ray here.

The model is a task, its version the revision served (``"1"`` for an artifact that is not live). Inputs: ``text`` and
optional ``text_pair``, BYTES tensors of shape [n] or [n, 1]; outputs: ``label`` (BYTES, the input's shape) and
``scores`` (FP32 [n, labels], the task's labels in order); an output asked with the parameter ``classification = k``
answers its top k as ``"score:index:label"`` strings (Triton's classification extension). Request parameters:
``raw_scores``, ``strict`` and ``truncation_direction`` as on /v1/classify, ``timeout`` in microseconds (Triton's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusionserve import __version__

from ..model.artifact import Artifact, TaskEntry
from ..model.runtime import Served
from .classify import parse_fields
from .schemas import ClassifyRequest, HTTPError

SERVER_NAME = "fusionserve"
PLATFORM = "fusionserve_onnx"
EXTENSIONS = ("classification", "binary_tensor_data", "model_configuration", "parameters")
INPUTS = ("text", "text_pair")
OUTPUTS = ("label", "scores")
_PARAMETERS = ("raw_scores", "strict", "truncation_direction", "timeout", "binary_data_output")
_SERVED_HEADS = ("classification",)  # the head kinds this protocol answers for (issue 35 adds others to /v1/classify)


def bad(message: str) -> HTTPError:
    """The caller's mistake in an inference request: 400 (the protocol's status for a bad request)."""
    return HTTPError(400, "invalid_request", message)


def version_of(served: Served) -> str:
    """The model version a revision is: its number, or "1" for an artifact that is not live."""
    return "1" if served.revision is None else str(served.revision)


def check_version(model: str, version: str, served: Served) -> None:
    """Raises HTTPError 404 ``unknown_version`` unless ``version`` is empty or the one ``served``."""
    if version and version != version_of(served):
        raise HTTPError(
            404,
            "unknown_version",
            f"version '{version:.40}' of model '{model:.128}' is not served; versions: {version_of(served)}",
        )


@dataclass(frozen=True)
class Tensor:
    """A tensor as read off the wire: BYTES elements as bytes, in row-major order."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: list[Any]


@dataclass(frozen=True)
class OutputAsk:
    """One output a request asks for: its name, ``classification`` (top k, 0: the tensor itself) and, over HTTP,
    whether its data comes as binary (None: as the request's ``binary_data_output`` says)."""

    name: str
    classification: int = 0
    binary: bool | None = None


@dataclass
class InferCall:
    """One inference request, read: the classify request, what to answer, and how."""

    model: str
    version: str
    id: str
    fields: dict[str, Any]
    rank: int  # of the ``text`` input: 1 ([n]) or 2 ([n, 1]); ``label`` answers in the same shape
    outputs: list[OutputAsk] = field(default_factory=lambda: [OutputAsk(name) for name in OUTPUTS])
    binary_output: bool = False


def bytes_elements(raw: bytes, where: str) -> list[bytes]:
    """The elements of a BYTES tensor in its raw form (each: a 4-byte little-endian length, then that many bytes).
    Raises HTTPError 400 naming ``where`` when the lengths do not add up to the data."""
    out, at, size = [], 0, len(raw)
    while at < size:
        if at + 4 > size:
            raise bad(f"{where}: {size - at} byte(s) left where a 4-byte element length was expected")
        (length,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + length > size:
            raise bad(f"{where}: an element of {length} bytes at byte {at - 4}, but only {size - at} byte(s) follow")
        out.append(raw[at : at + length])
        at += length
    return out


def bytes_raw(elements: list[bytes]) -> bytes:
    """BYTES elements in their raw form (see ``bytes_elements``)."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _texts(tensor: Tensor) -> tuple[int, list[str]]:
    """(rows, texts) of a ``text`` or ``text_pair`` tensor. Raises HTTPError 400 for a datatype but BYTES, a shape but
    [n] or [n, 1], data that is not n elements, or an element that is not UTF-8."""
    if tensor.datatype != "BYTES":
        raise bad(f"input '{tensor.name}': datatype {tensor.datatype!r:.20} is not served; send BYTES (UTF-8 texts)")
    shape = tensor.shape
    if not (1 <= len(shape) <= 2 and shape[0] >= 1 and (len(shape) == 1 or shape[1] == 1)):
        raise bad(f"input '{tensor.name}': shape {list(shape)} is not served; send [n] or [n, 1] with n >= 1")
    if len(tensor.data) != shape[0]:
        raise bad(f"input '{tensor.name}': shape {list(shape)} holds {shape[0]} element(s), the data has {len(tensor.data)}")
    texts = []
    for i, element in enumerate(tensor.data):
        if isinstance(element, str):
            texts.append(element)
            continue
        try:
            texts.append(bytes(element).decode("utf-8"))
        except (UnicodeDecodeError, TypeError):
            raise bad(f"input '{tensor.name}'[{i}]: not UTF-8 text, got {bytes(element)[:40]!r}") from None
    return shape[0], texts


def read_inputs(tensors: list[Tensor]) -> tuple[list[Any], int]:
    """The classify inputs of ``text`` (and ``text_pair``, row by row) and the rank of ``text``. Raises HTTPError 400
    for a missing ``text``, an input named twice or unknown, or a ``text_pair`` of another row count."""
    by_name: dict[str, Tensor] = {}
    for t in tensors:
        if t.name not in INPUTS:
            raise bad(f"input {t.name!r:.60} is not an input of this model; inputs: {', '.join(INPUTS)}")
        if t.name in by_name:
            raise bad(f"input '{t.name}' is given twice")
        by_name[t.name] = t
    if "text" not in by_name:
        raise bad("input 'text' is missing (a BYTES tensor of shape [n] or [n, 1]); 'text_pair' is optional")
    rows, texts = _texts(by_name["text"])
    if "text_pair" not in by_name:
        return list(texts), len(by_name["text"].shape)
    pair_rows, pairs = _texts(by_name["text_pair"])
    if pair_rows != rows:
        raise bad(f"input 'text_pair' has {pair_rows} row(s), 'text' has {rows}: one text_pair per text")
    return [{"text": a, "text_pair": b} for a, b in zip(texts, pairs, strict=True)], len(by_name["text"].shape)


def request_fields(model: str, inputs: list[Any], params: dict[str, Any]) -> dict[str, Any]:
    """The /v1/classify fields of a request for ``model``: its inputs and its parameters. Raises HTTPError 400 for a
    parameter not known (naming those that are) or a ``timeout`` that is not a whole number of microseconds."""
    unknown = sorted(set(params) - set(_PARAMETERS))
    if unknown:
        raise bad(f"parameter(s) {', '.join(map(repr, unknown))[:200]} not known; allowed: {', '.join(_PARAMETERS)}")
    fields = {"task": model, "inputs": inputs} | {
        k: params[k] for k in ("raw_scores", "strict", "truncation_direction") if k in params
    }
    if "timeout" in params:
        us = params["timeout"]
        if isinstance(us, bool) or not isinstance(us, int) or us < 1:
            raise bad(f"parameter 'timeout': a whole number of microseconds >= 1, got {us!r:.40}")
        fields["timeout_ms"] = max(1, -(-us // 1000))  # rounded up: a deadline is never earlier than asked
    return fields


def read_outputs(asked: list[dict[str, Any]]) -> list[OutputAsk]:
    """The outputs a request names (``[{"name", "parameters": {"classification", "binary_data"}}]``); none named:
    every output. Raises HTTPError 400 for an unknown output, one named twice, or a bad ``classification``."""
    if not asked:
        return [OutputAsk(name) for name in OUTPUTS]
    out, seen = [], set()
    for item in asked:
        name, params = item.get("name"), item.get("parameters") or {}
        if name not in OUTPUTS:
            raise bad(f"output {name!r:.60} is not an output of this model; outputs: {', '.join(OUTPUTS)}")
        if name in seen:
            raise bad(f"output '{name}' is asked for twice")
        seen.add(name)
        k = params.get("classification", 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise bad(f"output '{name}': parameter 'classification' must be a whole number >= 0, got {k!r:.40}")
        if k and name != "scores":
            raise bad(f"output '{name}': classification applies to the 'scores' output")
        binary = params.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise bad(f"output '{name}': parameter 'binary_data' must be true or false, got {binary!r:.40}")
        out.append(OutputAsk(name, k, binary))
    return out


def serves(entry: TaskEntry) -> bool:
    """Whether this protocol answers for the task: its head is one whose answer is ``label`` and ``scores``."""
    return entry.head in _SERVED_HEADS


def classification_only(entry: TaskEntry) -> None:
    """Raises HTTPError 400 ``unsupported_task`` for a task whose head is not a classification head: this protocol
    serves those only (its inference, metadata, configuration and readiness)."""
    if not serves(entry):
        raise HTTPError(
            400,
            "unsupported_task",
            f"model '{entry.name}' is a {entry.head} task; the Open Inference Protocol serves classification tasks "
            "only: use POST /v1/classify (or gRPC Classify) for it",
        )


def classify_request(call: InferCall, artifact: Artifact) -> ClassifyRequest:
    """The /v1/classify request of ``call``, validated by its model (HTTPError 422 as there), for a task whose head
    this protocol serves (HTTPError 400), known to the artifact (404; the classify path checks it again against the
    revision it answers from)."""
    entry = artifact.tasks.get(call.model)
    if entry is None:
        raise HTTPError(
            404, "unknown_task", f"unknown model '{call.model:.128}'; known models (tasks): {', '.join(artifact.tasks)}"
        )
    classification_only(entry)
    return parse_fields(call.fields)


@dataclass(frozen=True)
class OutTensor:
    """An output tensor, with its data as a numpy array (FP32) or a list of bytes (BYTES)."""

    name: str
    datatype: str
    shape: list[int]
    data: Any

    def raw(self) -> bytes:
        return bytes_raw(self.data) if self.datatype == "BYTES" else np.ascontiguousarray(self.data).tobytes()

    def json_data(self) -> Any:
        """The data for a JSON answer: texts, or the FP32 array (orjson writes each value as the float32 it is)."""
        if self.datatype == "BYTES":
            return [e.decode("utf-8") for e in self.data]
        return self.data.ravel()


def output_tensors(call: InferCall, answer: dict[str, Any]) -> list[OutTensor]:
    """The outputs ``call`` asks for, from one task's classify answer (its scores are in the task's label order)."""
    preds = answer["predictions"]
    n = len(preds)
    labels = list(preds[0]["scores"]) if preds else []
    scores = np.array([list(p["scores"].values()) for p in preds], dtype=np.float32).reshape(n, len(labels))
    out = []
    for ask in call.outputs:
        if ask.name == "label":
            shape = [n] if call.rank == 1 else [n, 1]
            out.append(OutTensor("label", "BYTES", shape, [p["label"].encode("utf-8") for p in preds]))
        elif ask.classification:
            k = min(ask.classification, len(labels))
            top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            data = [f"{scores[i, j]:f}:{j}:{labels[j]}".encode() for i in range(n) for j in top[i]]
            out.append(OutTensor("scores", "BYTES", [n, k], data))
        else:
            out.append(OutTensor("scores", "FP32", [n, len(labels)], scores))
    return out


# --- metadata and configuration ---------------------------------------------------------------------------------


def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}


def model_entry(served: Served, model: str, version: str) -> TaskEntry:
    """The task ``model`` at ``version`` (empty: the one served). Raises HTTPError 404 naming the known models or
    the version served, and 400 ``unsupported_task`` for a task whose head this protocol does not serve."""
    entry = served.artifact.tasks.get(model)
    if entry is None:
        known = ", ".join(served.artifact.tasks)
        raise HTTPError(404, "unknown_task", f"unknown model '{model:.128}'; known models (tasks): {known}"[:1000])
    check_version(model, version, served)
    classification_only(entry)
    return entry


def _tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


def model_metadata(served: Served, entry: TaskEntry) -> dict[str, Any]:
    """The protocol's model metadata, with the task's labels (``parameters.labels``: the columns of ``scores``)."""
    labels = list(entry.labels)
    scores = _tensor("scores", "FP32", [-1, len(labels)]) | {"parameters": {"labels": labels}}
    return {
        "name": entry.name,
        "versions": [version_of(served)],
        "platform": PLATFORM,
        "inputs": [_tensor("text", "BYTES", [-1, 1]), _tensor("text_pair", "BYTES", [-1, 1])],
        "outputs": [_tensor("label", "BYTES", [-1, 1]), scores],
        "parameters": {"labels": labels, "kind": entry.kind, "adapters": list(entry.adapters)},
    }


def model_config(entry: TaskEntry, max_inputs: int, batch_wait_ms: float, device: str) -> dict[str, Any]:
    """Triton's model configuration of a task, in Triton's JSON form (what its clients and perf_analyzer read): one
    request holds at most ``max_inputs`` rows; the labels are in ``parameters.labels`` (a JSON list, as a string)."""
    import json

    return {
        "name": entry.name,
        "platform": PLATFORM,
        "backend": SERVER_NAME,
        "max_batch_size": max_inputs,
        "input": [
            {"name": "text", "data_type": "TYPE_STRING", "dims": [1]},
            {"name": "text_pair", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
        ],
        "output": [
            {"name": "label", "data_type": "TYPE_STRING", "dims": [1]},
            {"name": "scores", "data_type": "TYPE_FP32", "dims": [len(entry.labels)]},
        ],
        "instance_group": [{"name": entry.name, "count": 1, "kind": "KIND_GPU" if device == "cuda" else "KIND_CPU"}],
        "dynamic_batching": {"max_queue_delay_microseconds": int(batch_wait_ms * 1000)},
        "parameters": {"labels": {"string_value": json.dumps(list(entry.labels))}},
    }
