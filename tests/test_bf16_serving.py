"""End to end with a bf16 artifact: the real `fusionserve serve` on 127.0.0.1 runs it with OpenVINO in its replicas and
answers over HTTP (one task, several tasks in one request, fusion activations) and gRPC as `OnnxRunner` does in-process.
Everything else about the server is precision-blind and covered by test_serving_e2e.py.

The server listens on every interface (--host 0.0.0.0): it is also the server of the loopback test of that host, which
then stops it with a group SIGINT (moved here from tests/test_loopback.py, whose test started a server of its own for
nothing else)."""

import os
import signal

import grpc
import numpy as np
import pytest

from fusionserve.export.artifact import export_artifact
from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc
from fusionserve.serving.model.predictions import TextInput, softmax
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.fault_helpers import group_signal_stops
from tests.serving_helpers import (
    MARK_ENV,
    call,
    carrying,
    free_port,
    launch,
    needs_shim,
    new_mark,
    only_the_serving_ports_beyond_loopback,
    stop,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(built_st, tmp_path_factory):
    """The bf16 artifact served with --host 0.0.0.0 and gRPC, as the leader of a process group of its own (as a
    terminal or systemd starts it), every process of it carrying a mark (what is left of them at the end is killed)."""
    art = tmp_path_factory.mktemp("bf16-serve") / "art"
    export_artifact(built_st.spec, art, "bf16", max_seq_len=16, progress=False, parity_grid="quick")
    grpc_port, mark = free_port("0.0.0.0"), new_mark()
    args = ("--threads", "1", "--host", "0.0.0.0", "--grpc-port", str(grpc_port))
    server = launch(art, art.parent / "server.log", *args, env=dict(os.environ, **{MARK_ENV: mark}), own_group=True)
    server.grpc_port = grpc_port
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    yield server, art, pb_grpc.ClassifierStub(channel), mark
    channel.close()
    stop(server)
    for pid in carrying(mark):
        os.kill(pid, signal.SIGKILL)


def test_bf16_artifact_served_over_http_and_grpc_answers_as_in_process(served):
    server, art, stub, _ = served
    local = OnnxRunner(art, device="cpu")
    assert local.artifact.manifest["precision"] == "bf16" and local.provider == "OpenVINO CPU"
    inputs = [SENTENCES[0], {"text": PAIRS[0][0], "text_pair": PAIRS[0][1]}]
    texts = [TextInput(SENTENCES[0]), TextInput(*PAIRS[0])]
    status, body = call(server.url + "/v1/classify", {"task": "rte", "inputs": inputs, "return_fusion_activations": True})
    assert status == 200, body
    probs = softmax(local.logits("rte", texts)[0].astype(np.float64))
    for pred, p in zip(body["predictions"], probs, strict=True):
        np.testing.assert_allclose([pred["scores"][label] for label in local.labels["rte"]], p, atol=1e-3)
        assert pred["label"] == local.labels["rte"][int(np.argmax(p))]
    values = np.asarray(body["fusion_activations"]["values"])  # (inputs, layers, adapters)
    np.testing.assert_allclose(values.sum(-1), 1.0, atol=1e-2)
    status, body = call(server.url + "/v1/classify", {"tasks": ["nli", "custom"], "inputs": inputs})
    assert status == 200, body
    for result in body["results"]:
        want = softmax(local.logits(result["task"], texts)[0].astype(np.float64))
        got = [[pred["scores"][label] for label in local.labels[result["task"]]] for pred in result["predictions"]]
        np.testing.assert_allclose(got, want, atol=1e-3)
    reply = stub.Classify(pb.ClassifyRequest(task="nli", inputs=[pb.Input(text=t) for t in SENTENCES[:3]]), timeout=60)
    want = softmax(local.logits("nli", [TextInput(t) for t in SENTENCES[:3]])[0].astype(np.float64))
    np.testing.assert_allclose([list(p.scores) for p in reply.predictions], want, atol=1e-3)


@needs_shim
def test_with_host_0_0_0_0_only_the_serving_ports_listen_beyond_loopback(served):
    """With --host 0.0.0.0 only the HTTP and gRPC ports are outside loopback, and they answer HTTP and gRPC at the
    machine's own address (tests/test_loopback.py: the shim, and --host 127.0.0.1). Then SIGINT to the server's process
    group (Ctrl-C in a terminal) stops everything of it with exit 0 (tests/fault_helpers.group_signal_stops; merged
    into the loopback test from tests/test_serving_faults.py). Last here: it stops the server."""
    server, _, _, mark = served
    only_the_serving_ports_beyond_loopback(server, server.grpc_port, "0.0.0.0")
    group_signal_stops(server, signal.SIGINT, mark)
