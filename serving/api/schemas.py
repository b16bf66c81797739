"""The HTTP request and response bodies (pydantic), and how a validation failure is told to the caller."""

import re
from dataclasses import asdict, dataclass
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
    model_validator,
)

from ..model.heads import HeadOptions
from ..options import (
    MAX_CHOICES,
    MAX_TASK_NAME_CHARS,
    MAX_TASKS_PER_REQUEST,
    MAX_TIMEOUT_MS,
    MEANINGFUL,
    bounded,
    check_ranges,
    default,
)

TIMEOUT_HEADER = "x-request-timeout-ms"
JSON = "application/json"

# a text must hold something the tokenizer keeps: whitespace, control and zero-width characters alone are refused
Text = Annotated[str, StringConstraints(strict=True, min_length=1, pattern=MEANINGFUL)]
TaskName = Annotated[str, StringConstraints(strict=True, max_length=MAX_TASK_NAME_CHARS)]


class PairInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text
    text_pair: Text | None = Field(None, description="second text of a pair, encoded as [CLS] text [SEP] text_pair [SEP]")


class ChoicesInput(BaseModel):
    """A multiple-choice input (checked by ``predictions.ChoiceInput``, which names what is wrong)."""

    model_config = ConfigDict(extra="forbid")
    text: StrictStr = Field(description="the context (a question, a sentence to continue)")
    choices: list[StrictStr] = Field(description=f"2 to {MAX_CHOICES} texts; each is run as the pair (text, choice)")


class QuestionInput(BaseModel):
    """An extractive question-answering input (checked by ``predictions.QAInput``)."""

    model_config = ConfigDict(extra="forbid")
    question: StrictStr
    context: StrictStr | None = Field(None, description="the text the answer is a span of; read in overlapping windows when long")


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: TaskName | None = Field(None, description="a task of the served artifact (GET /v1/tasks); or give 'tasks'")
    tasks: list[TaskName] | None = Field(
        None,
        min_length=1,
        max_length=MAX_TASKS_PER_REQUEST,
        description="several tasks, each answered for every input in one call (instead of 'task')",
    )
    inputs: list[Text | PairInput | ChoicesInput | QuestionInput] = Field(
        min_length=1,
        description="plain texts and/or {text, text_pair} objects (classification, regression, tagging), {text, choices} "
        "(multiple choice) or {question, context} (question answering), as each task's head takes them (GET /v1/tasks)",
    )
    return_fusion_activations: StrictBool = Field(
        False, description="add per input the fusion weights per layer and adapter, averaged over its tokens"
    )
    strict: StrictBool = Field(False, description="refuse (413) an input over the token limit instead of truncating it")
    raw_scores: StrictBool = Field(
        False, description="'score' and 'scores' hold the model's logits, unrounded, instead of rounded probabilities"
    )
    truncation_direction: Literal["right", "left"] = Field(
        "right",
        description="where an input over the token limit is cut: 'right' keeps its first tokens, 'left' its last "
        "([CLS] and [SEP] kept; a pair loses tokens from whichever text is longer, at that side)",
    )
    aggregation_strategy: StrictStr | None = Field(
        None,
        description="tagging tasks: none | simple | first | average | max, grouping word pieces into entities as "
        "transformers.pipeline('token-classification') does (none: one prediction per word piece)",
    )
    top_k: StrictInt | None = Field(None, description="question answering: the best answers to give (default 1)")
    max_answer_len: StrictInt | None = Field(None, description="question answering: longest answer in tokens (default 15)")
    handle_impossible_answer: StrictBool | None = Field(
        None, description="question answering: the empty answer may win (SQuAD 2.0 style; default false)"
    )
    doc_stride: StrictInt | None = Field(
        None, description="question answering: tokens two windows of a long context share (default 128)"
    )
    timeout_ms: int | None = Field(
        None,
        strict=True,
        ge=1,
        le=MAX_TIMEOUT_MS,
        description="deadline in ms from arrival (or the X-Request-Timeout-Ms header; the earlier counts): a request "
        "still waiting for the model then is dropped and answered 504 deadline_exceeded",
    )

    @model_validator(mode="after")
    def _one_way_to_name_tasks(self) -> "ClassifyRequest":
        if (self.task is None) == (self.tasks is None):
            raise ValueError("give exactly one of 'task' (one task) and 'tasks' (several)")
        if self.tasks is not None and len(set(self.tasks)) < len(self.tasks):
            twice = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
            raise ValueError(f"'tasks' names a task more than once: {', '.join(map(repr, twice[:5]))}")
        return self

    def head_options(self) -> HeadOptions:
        """The options for the tasks' heads; raises InputError for a value out of range."""
        return HeadOptions(
            self.aggregation_strategy, self.top_k, self.max_answer_len, self.handle_impossible_answer, self.doc_stride
        )

    @property
    def task_names(self) -> list[str]:
        return [self.task] if self.task is not None else list(self.tasks or ())


class Prediction(BaseModel):
    """A classification task's prediction."""

    label: str
    score: float = Field(description="the label's probability (its logit with raw_scores)")
    scores: dict[str, float] = Field(description="every label's probability (logit with raw_scores), in label order")
    truncated: bool = Field(False, description="the input was cut to the token limit")


class ScorePrediction(BaseModel):
    """A regression task's prediction: the head's value (no label, no softmax)."""

    score: float
    truncated: bool = False


class ChoicePrediction(BaseModel):
    """A multiple-choice task's prediction."""

    label: str = Field(description="the chosen choice's text")
    choice: int = Field(description="its index in the input's choices")
    scores: list[float] = Field(description="per choice, its probability (softmax over the choices; logits with raw_scores)")
    truncated: bool = False


class TokenTag(BaseModel):
    entity: str
    score: float
    index: int = Field(description="the token's position in the encoded input ([CLS] is 0)")
    word: str
    start: int | None = Field(description="character offsets into the input's text")
    end: int | None
    scores: dict[str, float] | None = Field(None, description="with raw_scores: every label's logit")


class Entity(BaseModel):
    entity_group: str
    score: float
    word: str
    start: int | None
    end: int | None


class TaggedPrediction(BaseModel):
    """A tagging task's prediction: ``tokens`` (aggregation_strategy none) or ``entities``."""

    tokens: list[TokenTag] | None = None
    entities: list[Entity] | None = None
    truncated: bool = False


class Answer(BaseModel):
    """A question-answering task's prediction (a list of them, best first, when top_k > 1)."""

    answer: str
    score: float
    start: int = Field(description="character offsets into the context")
    end: int


class FusionActivations(BaseModel):
    adapters: list[str]
    values: list[list[list[float]]] = Field(description="per input, per layer, per adapter (in 'adapters' order)")


class TaskAnswer(BaseModel):
    task: str
    predictions: list[Prediction | ScorePrediction | ChoicePrediction | TaggedPrediction | Answer | list[Answer]] = Field(
        description="one per input, in order, shaped by the task's head"
    )
    fusion_activations: FusionActivations | None = Field(None, description="when asked, for a fusion task")


class ClassifyResponse(TaskAnswer):
    """The answer to a request naming one ``task``."""


class MultiTaskResponse(BaseModel):
    """The answer to a request naming several ``tasks``: one entry per task, in the order asked for."""

    results: list[TaskAnswer]


@dataclass(frozen=True)
class Limits:
    """What one request may hold, over HTTP and gRPC alike (defaults and checks: serving/options.py, with the fixed
    limits on task names and error messages). Raises FusionServeError for a value out of range."""

    max_inputs: int = default("max_inputs")
    max_body_bytes: int = default("max_body_bytes")  # an HTTP body, or a gRPC message
    body_timeout_s: float = default("body_timeout_s")  # a body not complete by then is answered 408

    def __post_init__(self) -> None:
        check_ranges(asdict(self))


class HTTPError(Exception):
    """A refusal: HTTP status, a short machine-readable reason (also the metric label) and a message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        message = bounded(message)  # whatever it echoes, a refusal stays short (gRPC sends it in a trailer)
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def check_media(content_type: str | None, encoding: str | None) -> None:
    """A body must say it is JSON, uncompressed: a ``text/plain`` or form POST is what a cross-site page may send
    without a CORS preflight, and a compressed body would only fail later as "not valid JSON". Raises HTTPError 415."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != JSON and not (media.startswith("application/") and media.endswith("+json")):
        raise HTTPError(
            415, "unsupported_media_type", f"Content-Type {content_type or '(none)'!r:.100} is not supported; send {JSON}"
        )
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise HTTPError(
            415, "unsupported_media_type", f"Content-Encoding {encoding!r:.100} is not supported; send the body uncompressed"
        )


def timeout_header(value: str | None) -> int | None:
    """The ``X-Request-Timeout-Ms`` header's deadline. Raises HTTPError 422 for anything but a whole number of
    milliseconds 1..MAX_TIMEOUT_MS (named, the value shown cut short)."""
    if value is None:
        return None
    if value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_TIMEOUT_MS:
        return int(value)
    raise HTTPError(
        422,
        "invalid_request",
        f"X-Request-Timeout-Ms: must be a whole number of milliseconds 1..{MAX_TIMEOUT_MS}, got {value!r:.40}",
    )


def describe_validation_error(exc: ValidationError) -> str:
    """One line per bad field; an input that is neither a text nor a pair object is named once, not per union arm."""
    problems: dict[str, str] = {}
    for e in exc.errors():
        loc = e["loc"]
        if len(loc) >= 2 and loc[0] == "inputs" and isinstance(loc[1], int):
            item = e.get("input")
            where = f"inputs[{loc[1]}]"
            problems.setdefault(
                where,
                f'{where}: must be a non-empty string or an object {{"text", "text_pair"?}}, {{"text", "choices"}} or '
                f'{{"question", "context"}}, got {item!r:.60}',
            )
        else:
            where = ".".join(str(p) for p in loc) or "body"
            msg = e["msg"].removeprefix("Value error, ") if e["type"] == "value_error" else e["msg"].lower()
            problems.setdefault(where, f"{where}: {msg}")
    return "; ".join(list(problems.values())[:5])


_POSITION = re.compile(r"line (\d+) column (\d+)")


def describe_json_error(msg: str) -> str:
    """What is wrong with a body that is not JSON, from the parser's message; a lone UTF-16 surrogate escape (half of
    a pair, which is not a character) is named as such instead of the parser's "hex escape" wording."""
    detail = msg.removeprefix("Invalid JSON: ")
    if "surrogate" in detail or "hex escape" in detail:
        where = _POSITION.search(detail)
        at = f" at line {where.group(1)} column {where.group(2)}" if where else ""
        return (
            f"the body is not valid JSON: a \\uXXXX escape{at} is a lone UTF-16 surrogate (half of a pair, not a character); "
            "send the text as UTF-8, or a character outside the Basic Multilingual Plane as a full pair such as \\ud83d\\ude00"
        )
    return f"the body is not valid JSON: {detail}"
