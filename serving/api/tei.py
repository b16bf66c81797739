"""Compatibility routes for clients written for text-embeddings-inference (TEI) and the Hugging Face Inference API,
answered for the server's ``--default-task`` by the same ``Classifier`` as POST /v1/classify (same limits, key,
deadlines, metrics).

Requests (both routes): ``{"inputs": ..., "raw_scores": bool, "truncate": bool, "truncation_direction": "left" |
"right"}``, the options also accepted inside ``"parameters"`` (the Inference API's place for them) with its
``top_k`` and ``function_to_apply`` ("softmax", "sigmoid", "none"). ``inputs`` as TEI's OpenAPI description
(1.6.0, ``PredictInput``) has them: a text; a pair, as a list of exactly two texts; or a batch, a list whose items are
``[text]`` or ``[text, text_pair]`` (a bare text is taken as an item too). So ``["a", "b"]`` is one pair, as in TEI;
send ``[["a"], ["b"]]``, ``[["a", "b"]]`` or ``["a", "b", "c"]`` for batches. ``"truncate": false`` refuses an input over the token
limit (413, as ``"strict": true``); left out, the input is cut, as on /v1/classify.

Answers: each input's ``[{"label", "score"}, ...]`` sorted by score, highest first. ``POST /predict`` answers as TEI:
that list for one text or pair, a list of such lists for a batch. ``POST /`` answers as the Inference API: always a
list of lists, one per input (what ``huggingface_hub.InferenceClient(url).text_classification`` reads).

Both answer text classification only, as TEI's /predict does (TEI has no token classification or question answering):
a ``--default-task`` whose head is another kind (regression, multiple choice, tagging, question answering) is refused
when the server starts, and, should a live revision give the default task another head, each call is answered 422
``unsupported_task``, pointing at POST /v1/classify, which answers every kind.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from fusionserve.errors import FusionServeError

from ..model.artifact import Artifact, check_task
from ..model.heads import CLASSIFICATION, head
from .classify import parse_fields
from .schemas import ClassifyRequest, HTTPError, describe_json_error

_OPTIONS = ("raw_scores", "truncate", "truncation_direction", "timeout_ms")
_FUNCTIONS = ("softmax", "sigmoid", "none")


def unsupported(task: str, kind: str) -> str | None:
    """Why the compatibility routes cannot answer for ``task`` with a head of ``kind``; None when they can."""
    if kind == CLASSIFICATION:
        return None
    return (
        f"the default task '{task}' is {kind}; TEI's /predict and the Inference API's POST / answer text classification "
        "only: use POST /v1/classify, which answers every head"
    )


def check_default_task(artifact: Artifact, task: str | None) -> None:
    """Raises FusionServeError when ``task`` (the server's --default-task) is not a task of ``artifact``, or is one
    these routes cannot answer for (see ``unsupported``)."""
    if task is None:
        return
    check_task(artifact, task, "default_task")
    why = unsupported(task, head(artifact.tasks[task]))
    if why:
        raise FusionServeError(f"default_task: {why}")


def _bad(message: str) -> HTTPError:
    return HTTPError(422, "invalid_request", message)


def _inputs(value: Any) -> tuple[list[Any], bool]:
    """TEI's ``inputs`` as /v1/classify inputs, and whether it was a batch. Raises HTTPError 422 naming the shape."""

    def one(item: Any, where: str) -> Any:
        if isinstance(item, str):
            return item
        if isinstance(item, list) and len(item) == 1 and isinstance(item[0], str):
            return item[0]  # TEI's batch item for one text
        if isinstance(item, list) and len(item) == 2 and all(isinstance(t, str) for t in item):
            return {"text": item[0], "text_pair": item[1]}
        raise _bad(f"{where}: must be a text, [text] or a pair [text, text_pair], got {item!r:.60}")

    if isinstance(value, str):
        return [value], False
    if isinstance(value, list) and len(value) == 2 and all(isinstance(t, str) for t in value):
        return [one(value, "inputs")], False  # TEI reads two texts as one pair
    if isinstance(value, list) and value:
        return [one(item, f"inputs[{i}]") for i, item in enumerate(value)], True
    raise _bad(f"inputs: must be a text, a pair [text, text_pair] or a non-empty list of them, got {value!r:.60}")


def read_request(body: bytes, task: str) -> tuple[ClassifyRequest, bool, dict[str, Any]]:
    """A TEI / Inference API body as (the classify request for ``task``, whether ``inputs`` was a batch, the answer's
    shaping: ``top_k`` and ``function_to_apply``). Raises HTTPError 422 for what it cannot read."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(422, "malformed_json", describe_json_error(str(exc))) from None
    if not isinstance(data, dict) or "inputs" not in data:
        raise _bad('body: must be an object with "inputs" (and optional "parameters")')
    params = data.get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad(f"parameters: must be an object, got {params!r:.60}")
    unknown = sorted(
        (set(data) - {"inputs", "parameters", *_OPTIONS}) | (set(params) - {"top_k", "function_to_apply", *_OPTIONS})
    )
    if unknown:
        raise _bad(
            f"unknown field(s) {unknown}; allowed: inputs, parameters, {', '.join(_OPTIONS)}; in 'parameters': "
            f"{', '.join(_OPTIONS)}, top_k, function_to_apply"
        )
    options = {k: v for k, v in (data | params).items() if k in _OPTIONS and v is not None}
    inputs, batch = _inputs(data["inputs"])
    fields: dict[str, Any] = {"task": task, "inputs": inputs}
    if "truncation_direction" in options:  # TEI writes "Left" / "Right"
        direction = options["truncation_direction"]
        fields["truncation_direction"] = direction.lower() if isinstance(direction, str) else direction
    if "truncate" in options:
        if not isinstance(options["truncate"], bool):
            raise _bad(f"truncate: must be true or false, got {options['truncate']!r:.40}")
        fields["strict"] = not options["truncate"]
    function = params.get("function_to_apply") or ("none" if options.get("raw_scores") is True else "softmax")
    if function not in _FUNCTIONS:
        raise _bad(f"function_to_apply: {function!r:.40} is not known; allowed: {', '.join(_FUNCTIONS)}")
    fields["raw_scores"] = options.get("raw_scores", False) if function == "softmax" else True
    if "timeout_ms" in options:
        fields["timeout_ms"] = options["timeout_ms"]
    top_k = params.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise _bad(f"top_k: must be a whole number >= 1, got {top_k!r:.40}")
    return parse_fields(fields), batch, {"top_k": top_k, "function": function}


def predictions(answer: dict[str, Any], shaping: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per input, ``[{"label", "score"}, ...]`` sorted by score (highest first), cut to ``top_k``; sigmoid applied
    to the logits when asked."""
    out = []
    for pred in answer["predictions"]:
        scores = pred["scores"]
        if shaping["function"] == "sigmoid":
            scores = {lab: 1 / (1 + math.exp(-v)) if v >= -700 else 0.0 for lab, v in scores.items()}
        ranked = sorted(({"label": lab, "score": v} for lab, v in scores.items()), key=lambda p: -p["score"])
        out.append(ranked[: shaping["top_k"]] if shaping["top_k"] else ranked)
    return out
