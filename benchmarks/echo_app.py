"""The floor of a Python HTTP server on this machine: uvicorn + FastAPI, a route that reads a JSON body and
answers a small JSON object, no model. ``benchmarks/load.py`` runs it with
``python -m uvicorn benchmarks.echo_app:app`` beside the real server."""

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

app = FastAPI()


@app.post("/v1/classify")
async def classify(request: Request) -> Response:
    body = json.loads(await request.body())
    answer = {"task": body.get("task"), "predictions": [{"label": "x", "score": 1.0}] * len(body.get("inputs", []))}
    return Response(json.dumps(answer), media_type="application/json")


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
