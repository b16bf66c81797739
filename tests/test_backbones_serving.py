"""`serve`'s path on every backbone x adapter architecture, without Ray: the exported artifact (``arch_exported``) run
by the replica's batching (serving/batching.Scheduler: the artifact's tokenizer, ``Encoder.pad``, one
``OnnxRunner.run_rows`` pass over rows of several tasks), with single texts and text pairs in one request, gives
AdapterHub's logits for every task."""

import asyncio

import numpy as np
import pytest

from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.scheduler.batching import BatchLimits, BatchStats, Scheduler
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.backbone_models import TASKS

TOL = 1e-4
# singles and pairs interleaved, so every batch pads pairs and single texts together
INPUTS = [TextInput(s) for s in SENTENCES[:3]]
INPUTS = [x for i, s in enumerate(INPUTS) for x in (s, TextInput(*PAIRS[i]))] + [TextInput(s) for s in SENTENCES[3:]]


def _reference(built, task: str) -> np.ndarray:
    """AdapterHub's logits for INPUTS, in their order: singles and pairs are tokenized by the base model's own
    tokenizer in two batches (it takes no mixed batch)."""
    out = np.zeros((len(INPUTS), len(TASKS[task][3])), dtype=np.float32)
    for pairs in (False, True):
        idx = [i for i, x in enumerate(INPUTS) if (x.text_pair is not None) == pairs]
        firsts = [INPUTS[i].text for i in idx]
        seconds = [INPUTS[i].text_pair for i in idx] if pairs else None
        batch = dict(built.tokenizer(firsts, seconds, padding=True, return_tensors="pt"))
        out[idx] = built.reference_logits(task, batch).numpy()
    return out


@pytest.mark.parametrize(
    ("max_batch_size", "seq_buckets"),
    [(64, 0), (5, 16)],
    ids=["one-mixed-batch", "split-and-bucketed"],
)
def test_the_batching_path_gives_adapterhubs_logits(arch_built, arch_exported, max_batch_size, seq_buckets):
    """One request for every task: its rows (inputs x tasks) go through the scheduler as one batch mixing the four
    tasks, or split into batches of 5 (each crossing a task boundary somewhere) padded to a multiple of 16 tokens."""
    runner = OnnxRunner(arch_exported.folder, threads=1, device="cpu", seq_buckets=seq_buckets)
    assert runner.per_row_tasks
    batches: list[BatchStats] = []
    scheduler = Scheduler(runner, BatchLimits(max_batch_size=max_batch_size), batches.append)
    result = asyncio.run(scheduler.submit(list(TASKS), INPUTS))
    rows = len(INPUTS) * len(TASKS)
    assert [b.inputs for b in batches] == [min(max_batch_size, rows - k) for k in range(0, rows, max_batch_size)]
    assert sum(b.task == "mixed" for b in batches) >= (1 if max_batch_size > rows else 3)
    assert not any(result.truncated) and list(result.tasks) == list(TASKS)
    worst = {}
    for task, kind in ((t, k[0]) for t, k in TASKS.items()):
        got = result.tasks[task]
        worst[task] = float(np.abs(got.logits - _reference(arch_built, task)).max())
        assert (got.activations is not None) == (kind == "fusion")
        if got.activations is not None:  # (inputs, fusion layers, task adapters): each a softmax over the adapters
            assert got.activations.shape == (len(INPUTS), len(arch_exported.manifest["fusion_layers"]), len(TASKS[task][1]))
    assert max(worst.values()) <= TOL, worst
