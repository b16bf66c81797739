"""Triton's own client against a running `fusionserve serve` of the built-in model, in the tritonclient environment
(tests/triton_env.py), not fusionserve's: every task, answered through tritonclient's HTTP (binary and JSON tensors),
gRPC, and asyncio HTTP and gRPC clients, checked against POST /v1/classify on the same server (labels equal, the
largest score difference printed); with --demo, first the calls and answers docs/guides/open-inference.md shows.

    .venv-triton/bin/python benchmarks/oip_check.py HTTP_PORT GRPC_PORT API_KEY [--demo]
"""

import asyncio
import json
import sys
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

port, grpc_port, key = sys.argv[1], sys.argv[2], sys.argv[3]
url, gurl = f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
auth, gauth = {"Authorization": f"Bearer {key}"}, {"authorization": f"Bearer {key}"}
TEXTS = [
    "Manchester United beat Chelsea 3-1 in the Premier League, with two goals from their striker",
    "Shares of the retailer fell sharply after the company cut its profit forecast",
    "A gripping, beautifully shot film that never loses its nerve.",
    "I ordered these for my dog and he would not touch them.",
    "The plot meanders for two hours and the jokes land with a thud.",
    "Parliament voted late on Tuesday to extend the emergency measures.",
]
PAIR = ("A man is playing a guitar on stage.", "A person is performing music.")


def section(t):
    print(f"\n### {t}")


h = httpclient.InferenceServerClient(url)
g = grpcclient.InferenceServerClient(gurl)
if "--demo" in sys.argv:
    section("http live/ready")
    print(h.is_server_live(), h.is_server_ready(), h.is_model_ready("bbc_news", headers=dict(auth)))
    section("http server metadata")
    print(h.get_server_metadata(headers=dict(auth)))
    section("http model metadata")
    print(json.dumps(h.get_model_metadata("bbc_news", headers=dict(auth))))
    section("http model config")
    print(json.dumps(h.get_model_config("bbc_news", headers=dict(auth))))
    text = httpclient.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([[TEXTS[0]], [TEXTS[1]]], dtype=object))
    r = h.infer("bbc_news", [text], headers=dict(auth))
    section("http infer (binary, the default)")
    print(r.as_numpy("label"))
    print(r.as_numpy("scores"))
    print(r.get_response())
    r = h.infer("bbc_news", [text], outputs=[httpclient.InferRequestedOutput("scores", class_count=2)], headers=dict(auth))
    section("http classification k=2")
    print(r.as_numpy("scores"))
    a = httpclient.InferInput("text", [1, 1], "BYTES")
    a.set_data_from_numpy(np.array([[PAIR[0]]], dtype=object))
    b = httpclient.InferInput("text_pair", [1, 1], "BYTES")
    b.set_data_from_numpy(np.array([[PAIR[1]]], dtype=object))
    r = h.infer("snli", [a, b], headers=dict(auth), parameters={"raw_scores": True})
    section("http pair, raw scores")
    print(r.as_numpy("label"), r.as_numpy("scores"))
    section("grpc metadata/config")
    print(g.get_model_metadata("bbc_news", headers=dict(gauth)))
    print(g.get_model_config("bbc_news", headers=dict(gauth)))
    gt = grpcclient.InferInput("text", [2, 1], "BYTES")
    gt.set_data_from_numpy(np.array([[TEXTS[0]], [TEXTS[1]]], dtype=object))
    r = g.infer(
        "bbc_news",
        [gt],
        headers=dict(gauth),
        outputs=[grpcclient.InferRequestedOutput("label"), grpcclient.InferRequestedOutput("scores", class_count=3)],
    )
    section("grpc infer, classification k=3")
    print(r.as_numpy("label"))
    print(r.as_numpy("scores"))
    section("errors")
    for what, call in [
        ("no key (http)", lambda: h.infer("bbc_news", [text])),
        ("unknown model (http)", lambda: h.infer("bbc_newz", [text], headers=dict(auth))),
        ("unknown version (grpc)", lambda: g.infer("bbc_news", [gt], model_version="2", headers=dict(gauth))),
        (
            "wrong datatype (grpc)",
            lambda: g.infer(
                "bbc_news",
                [
                    (lambda t: (t.set_data_from_numpy(np.array([[1.5]], dtype=np.float32)), t)[1])(
                        grpcclient.InferInput("text", [1, 1], "FP32")
                    )
                ],
                headers=dict(gauth),
            ),
        ),
    ]:
        try:
            call()
            print(what, "-> answered")
        except InferenceServerException as e:
            print(f"{what}: [{e.status()}] {e.message()}")

# the check: every task, every client, the same answers as /v1/classify
tasks = list(
    json.loads(urllib.request.urlopen(urllib.request.Request(f"http://{url}/v1/tasks", headers=dict(auth))).read())[
        "tasks"
    ].items()
)


def classify(task, texts):
    body = json.dumps({"task": task, "inputs": texts}).encode()
    req = urllib.request.Request(f"http://{url}/v1/classify", data=body, headers={"content-type": "application/json", **auth})
    return json.loads(urllib.request.urlopen(req).read())["predictions"]


async def aio(module, u, head, task):
    c = module.InferenceServerClient(u)
    t = module.InferInput("text", [len(TEXTS), 1], "BYTES")
    t.set_data_from_numpy(np.array([[x] for x in TEXTS], dtype=object))
    r = await c.infer(task, [t], headers=dict(head))
    await c.close()
    return r.as_numpy("label"), r.as_numpy("scores")


def sync(client, module, head, task, binary=True):
    t = module.InferInput("text", [len(TEXTS), 1], "BYTES")
    data = np.array([[x] for x in TEXTS], dtype=object)
    if module is httpclient:
        t.set_data_from_numpy(data, binary_data=binary)
        outs = [module.InferRequestedOutput(n, binary_data=binary) for n in ("label", "scores")]
    else:
        t.set_data_from_numpy(data)
        outs = [module.InferRequestedOutput(n) for n in ("label", "scores")]
    r = client.infer(task, [t], outputs=outs, headers=dict(head))
    return r.as_numpy("label"), r.as_numpy("scores")


checked, worst, same = 0, 0.0, True
for task, info in tasks:
    want = classify(task, TEXTS)
    wl = [p["label"] for p in want]
    ws = np.array([[p["scores"][lab] for lab in info["labels"]] for p in want], dtype=np.float32)
    for _name, got in [
        ("http binary", sync(h, httpclient, auth, task)),
        ("http json", sync(h, httpclient, auth, task, False)),
        ("grpc", sync(g, grpcclient, gauth, task)),
        ("http aio", asyncio.run(aio(httpaio, url, auth, task))),
        ("grpc aio", asyncio.run(aio(grpcaio, gurl, gauth, task))),
    ]:
        labels = [x.decode() if isinstance(x, bytes) else x for x in got[0].reshape(-1)]
        same &= labels == wl
        worst = max(worst, float(np.abs(got[1].astype(np.float32) - ws).max()))
        checked += 1
print(
    f"\n### check: {len(tasks)} tasks x 5 clients (http binary, http json, grpc, http aio, grpc aio) x {len(TEXTS)} texts = {checked} calls: labels {'all equal' if same else 'DIFFER'} to /v1/classify's; largest |score difference| {worst}"
)
