"""End to end with an int8 artifact: the real `fusionserve serve` on 127.0.0.1 answers from the quantized graph, as
`OnnxRunner` does in-process, with nothing int8-specific in the server. One request path only: everything else about
the server is precision-blind and covered by test_serving_e2e.py."""

import numpy as np
import pytest

from fusionserve.serving.model.predictions import TextInput, softmax
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.export_helpers import default_int8
from tests.runtime_helpers import MAX_SEQ_LEN
from tests.serving_helpers import call, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(built_st, tmp_path_factory):
    art, _ = default_int8(built_st.spec, MAX_SEQ_LEN, tmp_path_factory)  # test_int8.py's export, made once per run
    log = tmp_path_factory.mktemp("int8-serve") / "server.log"
    with serving(art, log, "--threads", "1") as server:  # returns once the route answers
        yield server.url, art


def test_int8_artifact_served_over_http_answers_as_in_process(served):
    url, art = served
    local = OnnxRunner(art, device="cpu")
    assert local.artifact.manifest["precision"] == "int8"
    inputs = [SENTENCES[0], {"text": PAIRS[0][0], "text_pair": PAIRS[0][1]}]
    status, body = call(url + "/v1/classify", {"task": "rte", "inputs": inputs, "return_fusion_activations": True})
    assert status == 200, body
    want, _ = local.logits("rte", [TextInput(SENTENCES[0]), TextInput(*PAIRS[0])])
    probs = softmax(want.astype(np.float64))
    for pred, p in zip(body["predictions"], probs, strict=True):
        np.testing.assert_allclose([pred["scores"][label] for label in local.labels["rte"]], p, atol=1e-5)
        assert pred["label"] == local.labels["rte"][int(np.argmax(p))]
    values = np.asarray(body["fusion_activations"]["values"])  # (inputs, layers, adapters)
    np.testing.assert_allclose(values.sum(-1), 1.0, atol=1e-4)
    status, tasks = call(url + "/v1/tasks")
    assert status == 200 and tasks["max_seq_len"] == MAX_SEQ_LEN
