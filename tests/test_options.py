"""Every serve option has one home (serving/options.py): its default and its check are written once, and the
builder's arguments, the batch and request limits and the command's help all take them from there."""

import pytest

from fusionserve.cli.main import build_parser
from fusionserve.errors import FusionServeError
from fusionserve.serving import options
from fusionserve.serving.api.schemas import Limits
from fusionserve.serving.builder import AppArgs
from fusionserve.serving.scheduler.batching import BatchLimits


def test_every_default_comes_from_the_options_table():
    args = AppArgs(artifact="x")
    for name, option in options.OPTIONS.items():
        assert getattr(args, name) == option.default, name
    for limits in (BatchLimits(), Limits()):
        for name, value in vars(limits).items():
            assert value == options.default(name), name
    assert args.batch_limits() == BatchLimits() and args.request_limits() == Limits()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    helps = {a.dest: a.help for a in serve._actions}
    for name in ("max_batch_size", "max_batch_tokens", "max_queued", "max_inputs", "max_body_bytes"):
        assert f"(default {options.default(name)})" in helps[name], helps[name]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BatchLimits(max_batch_tokens=0), "max_batch_tokens = 0 is out of range; allowed: >= 1"),
        (lambda: BatchLimits(batch_wait_ms=20_000), "batch_wait_ms = 20000 is out of range; allowed: 0..10000"),
        (lambda: Limits(max_inputs=0), "max_inputs = 0 is out of range; allowed: >= 1"),
        (lambda: Limits(max_body_bytes=10), "max_body_bytes = 10 is out of range"),
        (lambda: AppArgs(artifact="x", max_body_bytes=2**31), "max_body_bytes = 2147483648 is out of range"),
        (lambda: AppArgs(artifact="x", max_batch_tokens=0), "max_batch_tokens = 0 is out of range; allowed: >= 1"),
    ],
)
def test_one_check_whichever_way_a_limit_is_made(make, message):
    """The request limits had no check at all, and max_batch_tokens had three bounds (>= 1, >= 8, >= the token
    limit) in four places; now one range per option, and the artifact's bound in one method."""
    with pytest.raises((FusionServeError, ValueError), match=message):
        make()


def test_a_batch_must_hold_one_input_of_the_token_limit():
    BatchLimits(max_batch_tokens=128).check_fits(128)
    with pytest.raises(FusionServeError, match="max_batch_tokens = 64 cannot hold one input of the artifact's token limit"):
        BatchLimits(max_batch_tokens=64).check_fits(128)


def test_error_messages_are_bounded():
    long = "unknown task '" + "x" * 20_000 + "'"
    cut = options.bounded(long)
    assert len(cut) == options.MAX_ERROR_CHARS and cut.startswith("unknown task 'xxx")
    assert cut.endswith(f"... ({len(long)} characters in all)")
    assert options.bounded("short") == "short"
