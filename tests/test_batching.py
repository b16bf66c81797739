"""The replica's continuous batching (serving/scheduler/batching.py), without Ray or HTTP: a real ONNX Runtime session on the
tiny model. Batches leave as soon as the model is free (no timer), the next one forms while one runs, a request
larger than a batch is split over several and answers exactly what its texts answer alone, the token budget and
the count cap hold, and a full queue refuses at once."""

import asyncio

import numpy as np
import pytest

from fusionserve.errors import FusionServeError
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.scheduler.batching import BatchLimits, BatchStats, Overloaded, Scheduler
from tests.batching_helpers import TEXTS, scheduled, until


def _solo(runner: OnnxRunner, task: str, inputs: list[TextInput]) -> np.ndarray:
    return np.concatenate([runner.logits(task, [x])[0] for x in inputs])


def test_one_request_at_an_idle_server_runs_alone_and_at_once(runner):
    batches: list[BatchStats] = []
    sched = Scheduler(runner, BatchLimits(max_batch_size=8), batches.append)
    result = asyncio.run(sched.submit("rte", TEXTS[:2]))
    assert [b.inputs for b in batches] == [2] and result.batches == 1
    np.testing.assert_allclose(result.logits, _solo(runner, "rte", TEXTS[:2]), atol=1e-5)


def test_the_next_batch_forms_while_one_runs(runner):
    sched, batches, gate = scheduled(runner, max_batch_size=8)

    async def scenario():
        first = await gate.hold(sched.submit("nli", TEXTS[:1]))  # the first batch is in the model
        rest = [asyncio.ensure_future(sched.submit("nli", [x])) for x in TEXTS[1:6]]
        await until(lambda: sched.queued_rows >= 5, "all five tokenized and queued behind the running batch")
        gate.release.set()
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(scenario())
    assert [b.inputs for b in batches] == [1, 5]  # the five waited for the model, not for a timer, and went together
    assert [b.requests for b in batches] == [1, 5]
    got = np.concatenate([first.logits, *[r.logits for r in rest]])
    np.testing.assert_allclose(got, _solo(runner, "nli", TEXTS[:6]), atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 9, 13])
def test_a_request_larger_than_a_batch_is_split_and_answers_as_alone(runner, n):
    batches: list[BatchStats] = []
    sched = Scheduler(runner, BatchLimits(max_batch_size=4), batches.append)
    inputs = [TEXTS[i % len(TEXTS)] for i in range(n)]
    result = asyncio.run(sched.submit("custom", inputs))
    assert [b.inputs for b in batches] == [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert result.batches == len(batches) and result.logits.shape[0] == n
    np.testing.assert_allclose(result.logits, _solo(runner, "custom", inputs), atol=1e-5)


def test_fusion_activations_come_back_per_input(runner):
    sched = Scheduler(runner, BatchLimits(max_batch_size=2))
    result = asyncio.run(sched.submit("rte", TEXTS[:3]))
    enc = runner.encoder.encode(TEXTS[:3])
    ref = runner.run("rte", enc, return_fusion_activations=True).fusion_activations  # (batch, layers, seq, adapters)
    mask = enc.attention_mask[:, None, :, None]
    np.testing.assert_allclose(result.activations, (ref * mask).sum(2) / mask.sum(2), atol=1e-5)


def test_the_token_budget_caps_a_batch(runner):
    batches: list[BatchStats] = []
    longest = max(t.length for t in runner.encoder.tokens(TEXTS))
    budget = 3 * longest  # at most 3 rows of the longest text
    sched = Scheduler(
        runner, BatchLimits(max_batch_size=64, max_batch_tokens=max(budget, runner.artifact.max_seq_len)), batches.append
    )
    asyncio.run(sched.submit("flat", TEXTS * 2))
    assert sum(b.inputs for b in batches) == len(TEXTS) * 2
    assert all(b.tokens <= max(budget, runner.artifact.max_seq_len) for b in batches)
    assert len(batches) > 1


def test_a_full_queue_refuses_at_once_and_the_rest_are_served(runner):
    sched, _, gate = scheduled(runner, max_batch_size=2, max_queued=3)

    async def scenario():
        running = await gate.hold(sched.submit("rte", TEXTS[:1]))
        waiting = [asyncio.ensure_future(sched.submit("rte", [x])) for x in TEXTS[1:4]]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="the limit is 3"):
            await sched.submit("rte", TEXTS[4:5])
        gate.release.set()
        return await running, await asyncio.gather(*waiting)

    first, rest = asyncio.run(scenario())
    assert first.logits.shape == (1, 3) and [r.logits.shape[0] for r in rest] == [1, 1, 1]


def test_a_full_queue_refuses_before_the_request_is_read(runner):
    """The classify core asks the scheduler first: a burst's excess is refused without its body being read or
    parsed (held back in Serve's semaphore instead, it got its 503 seconds late)."""
    from fusionserve.serving.api.classify import Classifier
    from fusionserve.serving.api.metrics import Metrics
    from fusionserve.serving.api.schemas import HTTPError, Limits

    sched, _, gate = scheduled(runner, max_batch_size=2, max_queued=1)
    core = Classifier(runner.encoder, sched, Limits(), Metrics())
    reads: list[str] = []

    async def read():
        reads.append("read")
        raise HTTPError(422, "malformed_json", "not JSON")

    async def scenario():
        running = await gate.hold(sched.submit("rte", TEXTS[:1]))
        waiting = asyncio.ensure_future(sched.submit("rte", TEXTS[1:2]))  # the one request that may wait
        await asyncio.sleep(0)
        refused = await core(read, "test")
        gate.release.set()
        await asyncio.gather(running, waiting)
        return refused, await core(read, "test")

    refused, later = asyncio.run(scenario())
    assert isinstance(refused, HTTPError) and (refused.status, refused.reason) == (503, "overloaded"), refused
    assert "the limit is 1" in refused.message and reads == ["read"]  # only the request after the queue drained was read
    assert isinstance(later, HTTPError) and later.status == 422


def test_a_failing_batch_fails_its_requests_and_the_next_are_served(runner):
    sched = Scheduler(runner, BatchLimits(max_batch_size=4))

    async def scenario():
        with pytest.raises(FusionServeError, match="unknown task"):
            await sched.submit("nope", TEXTS[:2])
        return await sched.submit("rte", TEXTS[:2])

    assert asyncio.run(scenario()).logits.shape == (2, 3)


def test_a_budget_below_one_input_is_refused(runner):
    with pytest.raises(FusionServeError, match="max_batch_tokens = 8 cannot hold one input"):
        Scheduler(runner, BatchLimits(max_batch_tokens=8))


def test_a_batch_mixing_tasks_answers_each_row_as_its_task_alone(runner):
    sched, batches, gate = scheduled(runner, max_batch_size=16)
    work = [(task, TEXTS[i % len(TEXTS)]) for i, task in enumerate(["rte", "nli", "alpha_only", "head_only", "custom", "rte"])]

    async def scenario():
        first = await gate.hold(sched.submit("flat", TEXTS[:1]))
        rest = [asyncio.ensure_future(sched.submit(task, [x])) for task, x in work]
        await until(lambda: sched.queued_rows >= len(work), "every request queued")
        gate.release.set()
        return await first, await asyncio.gather(*rest)

    _, results = asyncio.run(scenario())
    assert [len(b.tasks) for b in batches] == [1, 5] and batches[1].inputs == len(work)  # one batch of five tasks
    for (task, x), result in zip(work, results, strict=True):
        np.testing.assert_allclose(result.logits, runner.logits(task, [x])[0], atol=1e-5, err_msg=task)
        if runner.task(task).kind == "fusion":
            enc = runner.encoder.encode([x])
            ref = runner.run(task, enc, return_fusion_activations=True).fusion_activations.mean(axis=2)
            np.testing.assert_allclose(result.activations, ref, atol=1e-5, err_msg=task)
        else:
            assert result.activations is None


def test_one_request_for_several_tasks_tokenizes_once_and_answers_each(runner):
    batches: list[BatchStats] = []
    sched = Scheduler(runner, BatchLimits(max_batch_size=16), batches.append)
    result = asyncio.run(sched.submit(["rte", "alpha_only", "head_only"], TEXTS[:3]))
    assert list(result.tasks) == ["rte", "alpha_only", "head_only"] and len(result.truncated) == 3
    assert result.batches == 1 and len(batches) == 1 and batches[0].inputs == 9  # every row in one model call
    assert {t: s.inputs for t, s in batches[0].tasks.items()} == {"rte": 3, "alpha_only": 3, "head_only": 3}
    enc = runner.encoder.encode(TEXTS[:3])
    for task, answer in result.tasks.items():
        np.testing.assert_allclose(answer.logits, runner.logits(task, TEXTS[:3])[0], atol=1e-5, err_msg=task)
        if runner.task(task).kind == "fusion":  # (inputs, layers, adapters): each input's token means, as run alone
            ref = runner.run(task, enc, return_fusion_activations=True).fusion_activations
            mask = enc.attention_mask[:, None, :, None]
            np.testing.assert_allclose(answer.activations, (ref * mask).sum(2) / mask.sum(2), atol=1e-5)
        else:
            assert answer.activations is None, task
