"""One place bounds a text before it is tokenized (serving/model/tokenize.py, ``Encoder``): a text longer than the token
limit x CHARS_PER_TOKEN_BUDGET characters is cut there, for every caller, and flagged truncated; strict mode counts
tokens in the scheduler's tokenizer thread, never on the event loop. A real tokenizer and ONNX Runtime session."""

import asyncio
import threading

import numpy as np

from fusionserve.serving.api.classify import Classifier, parse_json
from fusionserve.serving.api.metrics import Metrics
from fusionserve.serving.api.schemas import HTTPError, Limits
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.options import CHARS_PER_TOKEN_BUDGET
from fusionserve.serving.scheduler.batching import BatchLimits, Scheduler

HUGE = "word " * 180_000  # 900 KB


def test_a_long_text_is_cut_before_it_is_tokenized(runner):
    """A 900 KB text was tokenized whole (1.2 s on the test artifact's server): counted, it had 180,002 tokens."""
    enc = runner.encoder
    assert enc.max_chars == enc.max_length * CHARS_PER_TOKEN_BUDGET
    assert enc.count_tokens([TextInput(HUGE)]) == enc.count_tokens([TextInput(HUGE[: enc.max_chars])])
    # the kept tokens are the cut text's, which are the whole text's: the cut changes no answer
    whole, cut = enc.tokens([TextInput(HUGE), TextInput(HUGE[: enc.max_chars])])
    np.testing.assert_array_equal(whole.ids, cut.ids)
    assert whole.truncated and cut.truncated
    pair = TextInput(HUGE, "a short hypothesis")
    assert enc.tokens([pair])[0].truncated and enc.encode([pair]).truncated == [True]


def test_a_cut_is_flagged_even_where_the_kept_tokens_fit(runner):
    """Whitespace costs characters, not tokens: such a text is cut all the same, and says so."""
    enc = runner.encoder
    sparse = TextInput("a" + " " * enc.max_chars + "b")
    assert enc.cut([sparse, TextInput("a b")]) == [True, False]
    (tokens,) = enc.tokens([sparse])
    assert tokens.truncated and tokens.length == 3  # [CLS] a [SEP]: "b" was past the cut


def test_strict_mode_counts_tokens_off_the_event_loop(runner):
    """With "strict": true the tokens were counted on the replica's event loop: a 900 KB text held /healthz for up
    to 1.1 s. Now the scheduler's tokenizer thread counts them, in the cut text."""
    counted_in: list[threading.Thread] = []
    real = runner.encoder.count_tokens

    def count(inputs):
        counted_in.append(threading.current_thread())
        return real(inputs)

    runner.encoder.count_tokens = count  # instrumentation only: the real tokenizer counts
    core = Classifier(runner.encoder, Scheduler(runner, BatchLimits()), Limits(), Metrics())
    body = ('{"task": "rte", "strict": true, "inputs": ["fits", "' + HUGE + '"]}').encode()

    async def classify() -> tuple[object, threading.Thread]:
        async def read():
            return parse_json(body)

        return await core(read, "test"), threading.current_thread()

    outcome, loop_thread = asyncio.run(classify())
    assert counted_in and loop_thread not in counted_in
    assert isinstance(outcome, HTTPError) and outcome.status == 413, outcome
    assert outcome.message.startswith("inputs[1] has ") and "+ tokens; the limit is" in outcome.message
