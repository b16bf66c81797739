"""One batch, rows of any tasks: the graph takes a task id per row (each row gathers its own task's folded fusion
matrices and head), in PyTorch and in ONNX Runtime, and every row answers exactly what it answers in a batch of
its task alone, for every task kind of the tiny model (dynamic and static fusions, a fusion with its query before
the LayerNorm, single adapters, a head-only task)."""

import numpy as np
import onnxruntime as ort
import torch

from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES

TEXTS = [TextInput(s) for s in SENTENCES] + [TextInput(a, b) for a, b in PAIRS]
TOL = 1e-5


def _per_row(tasks: list[str], n: int) -> list[str]:
    return [tasks[i % len(tasks)] for i in range(n)]


def test_pytorch_rows_of_every_task_answer_as_their_task_alone(spec_runner):
    model, enc = spec_runner.model, spec_runner.encoder.encode(TEXTS)
    ids, mask, types = (torch.from_numpy(t) for t in (enc.input_ids, enc.attention_mask, enc.token_type_ids))
    names = list(model.task_index)
    rows = _per_row(names, len(TEXTS))
    with torch.inference_mode():
        logits, acts = model(ids, mask, types, torch.tensor([model.task_index[t] for t in rows]))
        for task in names:
            alone, alone_acts = model(ids, mask, types, torch.tensor([model.task_index[task]]))
            mine = [i for i, t in enumerate(rows) if t == task]
            np.testing.assert_allclose(logits[mine].numpy(), alone[mine].numpy(), atol=TOL, err_msg=task)
            np.testing.assert_allclose(acts[mine].numpy(), alone_acts[mine].numpy(), atol=TOL, err_msg=task)
            # one id for the batch and that id for every row are the same thing
            per_row, _ = model(ids, mask, types, torch.full((len(TEXTS),), model.task_index[task]))
            np.testing.assert_allclose(per_row.numpy(), alone.numpy(), atol=TOL, err_msg=task)


def test_the_graph_takes_a_task_per_row_and_one_pass_serves_a_mixed_batch(artifacts):
    runner = OnnxRunner(artifacts.fp32, threads=1, device="cpu")
    assert runner.per_row_tasks
    shapes = {i.name: i.shape for i in runner.session.get_inputs()}
    assert shapes["task_id"] == ["task_rows"]
    assert "(batch,)" in runner.artifact.manifest["inputs"]["task_id"]
    enc = runner.encoder.encode(TEXTS)
    names = list(runner.artifact.tasks)
    rows = _per_row(names, len(TEXTS))
    calls = []
    real = runner.session.run
    runner.session.run = lambda *a, **k: calls.append(1) or real(*a, **k)  # counts passes; the real session computes
    out = runner.run_rows(rows, enc, return_fusion_activations=True)
    assert len(calls) == 1
    for task in names:
        alone = runner.run(task, enc, return_fusion_activations=runner.artifact.tasks[task].kind == "fusion")
        for i in (i for i, t in enumerate(rows) if t == task):
            np.testing.assert_allclose(out.logits[i], alone.logits[i], atol=TOL, err_msg=task)
            if alone.fusion_activations is None:
                assert out.fusion_activations[i] is None
            else:
                np.testing.assert_allclose(out.fusion_activations[i], alone.fusion_activations[i], atol=TOL, err_msg=task)


def test_onnx_and_pytorch_agree_on_a_mixed_batch(artifacts, spec_runner):
    model = spec_runner.model
    session = ort.InferenceSession(str(artifacts.fp32 / "model.onnx"), providers=["CPUExecutionProvider"])
    enc = spec_runner.encoder.encode(TEXTS)
    task_id = np.arange(len(TEXTS), dtype=np.int64) % len(model.task_index)
    feeds = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.token_type_ids}
    got = session.run(None, {**feeds, "task_id": task_id})
    with torch.inference_mode():
        want = model(*(torch.from_numpy(v) for v in feeds.values()), torch.from_numpy(task_id))
    real = enc.attention_mask[:, None, :, None].astype(bool)
    np.testing.assert_allclose(got[0], want[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(got[1] * real, want[1].numpy() * real, atol=1e-4)
