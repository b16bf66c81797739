"""Every serve option's one home: its default and its check, written once here. ``AppArgs`` (the builder's and
``fusionserve serve``'s arguments), ``BatchLimits`` (how batches form), ``Limits`` (what a request may hold) and the
command's help all take their defaults from ``OPTIONS`` and are checked by ``check_ranges``; nothing else writes a
default or a bound of these. The fixed request limits (not options) are here too, shared by HTTP and gRPC.

No imports beyond the standard library: the CLI reads the defaults for its help without loading the server.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionserve.errors import FusionServeError, InputError


@dataclass(frozen=True)
class Option:
    default: Any
    ok: Callable[[Any], bool]
    allowed: str
    choice: bool = False  # one of a list of names (said "is not known"), not a value in a range


def _opt(default: Any, ok: Callable[[Any], bool], allowed: str, optional: bool = False) -> Option:
    return Option(default, (lambda v: v is None or ok(v)) if optional else ok, allowed)


def _choice(default: str, choices: tuple[str, ...]) -> Option:
    return Option(default, lambda v: v in choices, ", ".join(choices), choice=True)


DEVICES = ("auto", "cpu", "cuda")  # where replicas run (serving/model/runtime.py resolves auto)


OPTIONS: dict[str, Option] = {
    "replicas": _opt(1, lambda v: v >= 1, ">= 1"),
    "min_replicas": _opt(None, lambda v: v >= 1, ">= 1", optional=True),  # both set: Serve's autoscaling
    "max_replicas": _opt(None, lambda v: v >= 1, ">= 1", optional=True),
    "target_ongoing_requests": _opt(2.0, lambda v: v > 0, "> 0"),
    "upscale_delay_s": _opt(30.0, lambda v: v >= 0, ">= 0"),
    "downscale_delay_s": _opt(600.0, lambda v: v >= 0, ">= 0"),
    "look_back_period_s": _opt(30.0, lambda v: v > 0, "> 0"),
    "max_batch_size": _opt(32, lambda v: v >= 1, ">= 1"),
    # static bound only: a batch must also hold one input of the artifact's token limit (BatchLimits.check_fits)
    "max_batch_tokens": _opt(16384, lambda v: v >= 1, ">= 1"),
    "batch_wait_ms": _opt(0.0, lambda v: 0 <= v <= 10_000, "0..10000"),
    "max_queued": _opt(64, lambda v: v >= 1, ">= 1"),  # 0 would refuse every request (and Serve refuses it)
    # default: max(ONGOING_FLOOR, max_queued + max_batch_size), AppArgs.ongoing_per_replica
    "max_ongoing": _opt(None, lambda v: v >= 1, ">= 1", optional=True),
    "max_inputs": _opt(64, lambda v: v >= 1, ">= 1"),
    "max_body_bytes": _opt(1_000_000, lambda v: 1024 <= v <= MAX_BODY_BYTES_CAP, f"1024..{2**30}"),
    "body_timeout_s": _opt(10.0, lambda v: 0 < v <= 3600, "0..3600"),
    "threads": _opt(None, lambda v: v >= 1, ">= 1", optional=True),  # default: the machine's CPUs / (max) replicas
    "device": _choice("auto", DEVICES),
    "gpus_per_replica": _opt(None, lambda v: 0 < v <= 8, "0..8", optional=True),
    # the environment variable holding the API key(s) in every replica's process (never the key itself: see
    # serving/api/auth.py); set, every model route asks for a key, and a replica without one refuses to start
    "api_key_env": _opt(None, lambda v: re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v) is not None, "a variable name", True),
    "open_metrics": _opt(True, lambda v: isinstance(v, bool), "true or false"),  # false: /metrics asks for the key too
    # TEI's POST /predict and the Inference API's POST / answer for this task (checked against the artifact's tasks)
    "default_task": _opt(None, lambda v: is_task_name(v), "a task name", optional=True),
    # OpenTelemetry traces (serving/api/tracing.py): the OTLP/HTTP collector (a base URL, or its /v1/traces URL);
    # unset, the standard OTEL_EXPORTER_OTLP_* variables may name one; neither: no tracing, nothing started
    "otlp_endpoint": _opt(None, lambda v: re.fullmatch(r"https?://[^\s/]+(/\S*)?", v) is not None, "an http(s):// URL", True),
    "trace_sample_ratio": _opt(1.0, lambda v: 0 <= v <= 1, "0..1"),  # share of traces kept (a caller's sampled flag wins)
    "log_format": _opt("text", lambda v: v in ("text", "json"), "text or json"),  # json: one object a line, trace ids
}
ONGOING_FLOOR = 1024  # the least of max_ongoing's default (requests Serve hands a replica at once)
MAX_BODY_BYTES_CAP = 2**30  # gRPC's message limit must stay under 2 GiB (a signed 32-bit length)

# --- fixed request limits, the same over HTTP and gRPC ------------------------------------------------------------
MAX_TASK_NAME_CHARS = 128  # a task name in a request, and the longest name an artifact's task may have
# what a task may be called, wherever a name is made (a spec's tasks, `tasks add`, --default-task): a name every
# client can send (within the request limit above), and every file system can hold (task files are named by it)
TASK_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{MAX_TASK_NAME_CHARS - 1}}}")
TASK_NAME_RULE = (
    f"a task name is 1 to {MAX_TASK_NAME_CHARS} characters of letters, digits, '_', '-' and '.', starting with a letter, "
    "a digit or '_'"
)
MAX_TASKS_PER_REQUEST = 64  # names in "tasks"
MAX_TIMEOUT_MS = 3_600_000  # the longest deadline a request may give (timeout_ms, X-Request-Timeout-Ms): an hour
# choices of one multiple-choice input: each is a row of its own (a (context, choice) pair), counted against the
# request's --max-inputs like any row; AdapterHub's num_choices is the count a head was trained with, not this bound
MIN_CHOICES, MAX_CHOICES = 2, 64
MAX_TOP_K = 100  # answers one question-answering input may ask for (top_k)
MAX_ERROR_CHARS = 1000  # an error message (HTTP body, gRPC details: HTTP/2 trailers are limited to ~8 KB)
# a text is cut at (token limit x this) characters before it is tokenized: far above what the kept tokens need (a
# WordPiece token covers ~4-5 characters of English, a word longer than 100 characters is one [UNK]), so the cut
# changes no answer of an ordinary text, and a 900 KB text costs what ~16 KB cost to tokenize (flagged `truncated`)
CHARS_PER_TOKEN_BUDGET = 32
# a text must hold a character other than whitespace, controls and zero-width/format characters (what the
# tokenizer removes, leaving nothing to classify); the same class in Python's re and pydantic's Rust regex
MEANINGFUL = r"[^\s\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb]"
_MEANINGFUL = re.compile(MEANINGFUL)


def default(name: str) -> Any:
    """The default of option ``name``."""
    return OPTIONS[name].default


def is_task_name(name: object) -> bool:
    """Whether ``name`` follows the rule every task name follows (TASK_NAME)."""
    return isinstance(name, str) and TASK_NAME.fullmatch(name) is not None


def check_task_name(name: object) -> None:
    """Raise InputError for a ``name`` that no task may have, naming it and the rule."""
    if not is_task_name(name):
        shown = repr(name) if len(repr(name)) <= 60 else f"{repr(name)[:40]}... ({len(str(name))} characters)"
        raise InputError(f"{shown} is not a task name: {TASK_NAME_RULE}")


def meaningful(text: str) -> bool:
    """``text`` holds something the tokenizer keeps (see MEANINGFUL)."""
    return _MEANINGFUL.search(text) is not None


def bounded(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how much was left out: every error message a caller gets goes
    through here (an echoed input can be any length). The cut is marked with the message's full length."""
    if len(message) <= limit:
        return message
    tail = f"... ({len(message)} characters in all)"
    return message[: limit - len(tail)] + tail


def check_ranges(values: dict[str, Any], flags: bool = False) -> None:
    """Raise FusionServeError for the first of ``values`` out of range, named as an option (``--max-batch-size``)
    when ``flags``, else as an argument (``max_batch_size``). Names that are not options are ignored."""
    for name, value in values.items():
        option = OPTIONS.get(name)
        if option is not None and not option.ok(value):
            shown = "--" + name.replace("_", "-") if flags else name
            if option.choice:
                raise FusionServeError(f"{shown} = {value!r} is not known; allowed: {option.allowed}")
            raise FusionServeError(f"{shown} = {value} is out of range; allowed: {option.allowed}")
