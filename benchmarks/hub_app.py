"""AdapterHub's eager model behind FastAPI: what a user serves without fusionserve (issue 38's server baseline).

    HUB_ROOT=DIR HUB_BASE=FOLDER [HUB_ADAPTERS=8] [HUB_AUTOCAST=bf16] [HUB_MAX_LENGTH=128] \\
        python -m uvicorn benchmarks.hub_app:app --port P

The model is ``benchmarks.models.build(HUB_ROOT, HUB_BASE, HUB_ADAPTERS)``: the same seed, so the same weights as the
spec that build wrote there and fusionserve exported (the adapters library's Fuse over all adapters, the first task's
head). ``POST /v1/classify`` takes fusionserve's request body (``{"task": ..., "inputs": [text, ...]}``), tokenizes
with the base model's tokenizer (truncated at HUB_MAX_LENGTH tokens), runs one forward pass per request under
``torch.inference_mode()`` (and ``torch.autocast("cpu", torch.bfloat16)`` with HUB_AUTOCAST=bf16, the one line a
user adds), one request at a time (a lock: two forward passes at once only share the same cores), and answers the
top label and its softmax score per text. torch uses every core this process may use."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, HTTPException

from benchmarks.models import build

_state: dict[str, Any] = {}
_lock = threading.Lock()


def _load() -> None:
    from transformers import AutoTokenizer

    base = Path(os.environ["HUB_BASE"])
    model = build(Path(os.environ["HUB_ROOT"]), base, int(os.environ.get("HUB_ADAPTERS", "8"))).reference
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    _state.update(
        model=model, tokenizer=AutoTokenizer.from_pretrained(str(base)), max_length=int(os.environ.get("HUB_MAX_LENGTH", "128"))
    )
    _state["autocast"] = os.environ.get("HUB_AUTOCAST", "") == "bf16"


@contextlib.asynccontextmanager
async def _lifespan(_: FastAPI) -> AsyncIterator[None]:
    _load()
    yield


app = FastAPI(lifespan=_lifespan)


@app.post("/v1/classify")
def classify(body: dict[str, Any]) -> dict[str, Any]:  # a plain def: FastAPI runs it in its thread pool
    texts = body.get("inputs")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise HTTPException(422, "inputs: a non-empty list of strings")
    enc = _state["tokenizer"](texts, padding=True, truncation=True, max_length=_state["max_length"], return_tensors="pt")
    cast = torch.autocast("cpu", torch.bfloat16) if _state["autocast"] else contextlib.nullcontext()
    with _lock, torch.inference_mode(), cast:
        logits = _state["model"](**enc).logits.float()
    probs = torch.softmax(logits, dim=-1)
    score, label = probs.max(dim=-1)
    return {
        "task": body.get("task"),
        "predictions": [{"label": f"LABEL_{i}", "score": float(s)} for i, s in zip(label.tolist(), score.tolist(), strict=True)],
    }


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}
