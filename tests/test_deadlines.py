"""Deadlines and abandoned requests in the replica's batching (serving/scheduler/batching.py), without Ray or HTTP: a real ONNX
Runtime session on the tiny model, held inside a batch by ``Gate`` so that a request is still waiting when its
deadline passes or its caller goes away. Dropped requests never reach the model, free their place in the queue, and
the requests around them are answered as usual."""

import asyncio
import time

import numpy as np
import pytest

from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.scheduler.batching import BatchLimits, DeadlineExceeded, Scheduler
from tests.adapterhub_models import SENTENCES
from tests.batching_helpers import TEXTS, scheduled, until


def test_a_request_still_queued_at_its_deadline_is_dropped_before_the_model_runs_it(runner):
    sched, batches, gate = scheduled(runner, max_batch_size=8)

    async def scenario():
        busy = await gate.hold(sched.submit("rte", TEXTS[:1]))
        late = asyncio.ensure_future(sched.submit("rte", TEXTS[1:4], deadline=time.monotonic() + 0.05))
        with pytest.raises(DeadlineExceeded, match="passed its deadline"):
            await late
        # answered while the batch ahead of it still holds the model: at its deadline, not when the model is free
        assert not busy.done() and sched.waiting == 0 and sched.queued_rows == 0
        after = asyncio.ensure_future(sched.submit("rte", TEXTS[4:5]))
        gate.release.set()
        return await busy, await after

    _, after = asyncio.run(scenario())
    assert [b.inputs for b in batches] == [1, 1]  # the late request's 3 inputs never reached the model
    np.testing.assert_allclose(after.logits, runner.logits("rte", TEXTS[4:5])[0], atol=1e-5)


def test_a_deadline_passing_once_the_model_has_the_request_changes_nothing(runner):
    sched, _, gate = scheduled(runner, max_batch_size=8)

    async def scenario():
        running = await gate.hold(sched.submit("nli", TEXTS[:2], deadline=time.monotonic() + 0.05))
        await asyncio.sleep(0.1)  # its deadline passes while its batch runs
        gate.release.set()
        return await running

    result = asyncio.run(scenario())
    np.testing.assert_allclose(result.logits, runner.logits("nli", TEXTS[:2])[0], atol=1e-5)


def test_a_request_whose_caller_goes_away_is_dropped_and_frees_its_place(runner):
    sched, batches, gate = scheduled(runner, max_batch_size=2, max_queued=2)

    async def scenario():
        busy = await gate.hold(sched.submit("custom", TEXTS[:1]))
        gone = asyncio.ensure_future(sched.submit("custom", TEXTS[1:6]))  # 5 inputs: 3 batches of 2
        await until(lambda: sched.queued_rows == 5, "queued")
        gone.cancel()  # what Serve does to the handler of a client that disconnected
        await asyncio.sleep(0)
        assert gone.cancelled() and sched.waiting == 0 and sched.queued_rows == 0
        gate.release.set()
        await busy
        return await sched.submit("custom", TEXTS[6:7])  # the place it held is free again

    asyncio.run(scenario())
    assert [b.inputs for b in batches] == [1, 1]


def test_a_cancelled_request_keeps_what_a_running_batch_computes_and_drops_the_rest(runner):
    sched, batches, gate = scheduled(runner, max_batch_size=2)

    async def scenario():
        job = await gate.hold(sched.submit("rte", TEXTS[:6]))  # 3 batches of 2
        job.cancel()
        await asyncio.sleep(0)
        gate.release.set()
        await until(lambda: sched.waiting == 0 and not sched.queued_rows, "drained")
        await asyncio.sleep(0.2)  # room for a wrong second batch to show up

    asyncio.run(scenario())
    assert [b.inputs for b in batches] == [2]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_the_truncation_direction_reaches_the_tokenizer(runner, direction):
    long = TextInput(" ".join(SENTENCES * 6))
    sched = Scheduler(runner, BatchLimits())
    result = asyncio.run(sched.submit("rte", [long], truncation=direction))
    want = runner.run("rte", runner.encoder.encode([long], direction)).logits
    np.testing.assert_allclose(result.logits, want, atol=1e-5)
    assert result.truncated == [True]
    other = runner.run("rte", runner.encoder.encode([long], "left" if direction == "right" else "right")).logits
    assert not np.allclose(want, other, atol=1e-4)  # the two directions differ on this text
