"""Small defects found by reading (issue 40, item 9): the activation metrics of a batch answered on an older revision
carry that revision's adapter names; TEI's refusal of an unknown field says where its options go; `serve --help`
says what --max-ongoing defaults to."""

import asyncio
from types import SimpleNamespace

import pytest

from fusionserve.cli.main import build_parser, main
from fusionserve.serving.model.predictions import TextInput
from tests.live_helpers import make_live


def test_activation_metrics_name_the_adapters_of_the_revision_that_answered(tmp_path):
    """A replica labelled a batch's activation sums with the adapter names of its latest revision, not the batch's:
    a task replaced by a fusion over the same adapters in another order had its figures under each other's names. A
    real runner and scheduler on a live artifact, with the replica's own batch hook."""
    from fusionserve.serving.api.app import FusionServe
    from fusionserve.serving.api.metrics import Metrics
    from fusionserve.serving.model.runtime import OnnxRunner
    from fusionserve.serving.scheduler.batching import BatchLimits, Scheduler

    live = make_live(tmp_path / "model")
    runner = OnnxRunner(live.artifact, threads=1)
    replica = SimpleNamespace(runner=runner, stats=Metrics())
    scheduler = Scheduler(runner, BatchLimits(), lambda batch: FusionServe._on_batch(replica, batch))
    first = runner.served
    assert first.artifact.tasks["custom"].adapters == ("gamma", "alpha")
    root = live.root
    replace = ["tasks", "add", live.artifact, "custom", "--fusion", root / "fusions/flat", "--head", root / "heads/flat"]
    assert main([str(a) for a in [*replace, "--replace"]]) == 0
    assert runner.refresh() and runner.served.artifact.tasks["custom"].adapters == ("alpha", "gamma")

    async def ask():  # a request admitted on revision 0, answered from it
        return await scheduler.submit("custom", (TextInput("a fine film, if a little long"),), served=first)

    result = asyncio.run(ask())
    replica.stats.flush()
    means = result.activations[0]  # (layers, adapters of revision 0's custom)
    for layer in range(means.shape[0]):
        for j, adapter in enumerate(("gamma", "alpha")):
            got = replica.stats.registry.get_sample_value(
                "fusionserve_fusion_activation_weight_sum_total", {"task": "custom", "layer": str(layer), "adapter": adapter}
            )
            assert got == pytest.approx(float(means[layer, j]), abs=1e-6), (layer, adapter)


def test_teis_refusal_of_an_unknown_field_says_where_top_k_goes():
    """It listed top_k and function_to_apply as allowed at the top level, and then refused them there."""
    from fusionserve.serving.api.schemas import HTTPError
    from fusionserve.serving.api.tei import read_request

    with pytest.raises(HTTPError) as refused:
        read_request(b'{"inputs": "a fine film", "top_k": 1}', "rte")
    message = refused.value.message
    allowed_at_top = message.split("allowed:", 1)[1].split(";", 1)[0]
    assert "top_k" not in allowed_at_top and "function_to_apply" not in allowed_at_top, message
    assert "'parameters'" in message and "top_k" in message, message
    read_request(b'{"inputs": "a fine film", "parameters": {"top_k": 1, "function_to_apply": "sigmoid"}}', "rte")


def test_serve_help_says_what_max_ongoing_defaults_to(capsys):
    """It said 1024, while the default is max(1024, --max-queued + --max-batch-size)."""
    from fusionserve.serving.options import ONGOING_FLOOR

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default max({ONGOING_FLOOR}, --max-queued + --max-batch-size)" in text, text
