"""Multiple choice's answer (serving/model/predictions.choice_scores): a softmax over the choices, however many."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusionserve.serving.model.predictions import choice_scores


@pytest.mark.parametrize("k", [2, 3, 5, 16])
def test_a_softmax_over_any_number_of_choices(k):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(k, 1)).astype(np.float32) * 3  # the graph's logits column, one row per choice
    choices = [f"choice {i}" for i in range(k)]
    out = choice_scores(choices, logits)
    expected = torch.softmax(torch.from_numpy(logits[:, 0]).double(), dim=0).numpy()
    assert out["choice"] == int(np.argmax(logits)) and out["label"] == choices[out["choice"]]
    np.testing.assert_allclose(out["scores"], expected, atol=5e-7)
    assert sum(out["scores"]) == pytest.approx(1.0, abs=1e-5)
    raw = choice_scores(choices, logits, raw_scores=True)
    assert raw["scores"] == [float(v) for v in logits[:, 0]] and raw["choice"] == out["choice"]


def test_logits_must_be_one_per_choice():
    with pytest.raises(ValueError, match="3 logits for 2 choices"):
        choice_scores(["a", "b"], np.zeros(3))
    assert choice_scores(["a", "b"], np.zeros(2)) == {"label": "a", "choice": 0, "scores": [0.5, 0.5]}
