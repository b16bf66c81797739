"""What a ``fusionserve score`` run is asked to do: one frozen, validated configuration shared by the local run
(``score.py``) and the Ray Data run (``score_ray.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fusionserve.errors import InputError
from fusionserve.serving.model.heads import HeadOptions, as_flag
from fusionserve.serving.model.tokenize import TRUNCATION_DIRECTIONS

from .files import MAX_ROW_BYTES
from .readers import InputFields


@dataclass(frozen=True)
class ScoreConfig:
    """What ``fusionserve score`` does; ``output`` None: ``<input stem>.scored<input suffix>`` beside the input."""

    model: Path
    task: str | tuple[str, ...]  # one task, or several: each adds its own columns, in one pass over the file
    input: Path
    output: Path | None = None
    text_field: str = "text"
    pair_field: str | None = None
    batch_size: int = 32
    chunk_size: int = 1024
    max_row_bytes: int = MAX_ROW_BYTES  # a longer row is reported as bad, and the job goes on
    all_scores: bool = False
    activations: bool = False
    prefix: str = ""
    threads: int | None = None
    overwrite: bool = False
    progress: bool = True
    ray: bool = False
    ray_address: str | None = None
    ray_actors: int | None = None
    truncation_direction: str = "right"  # where a text over the token limit is cut: right keeps its start, left its end
    raw_scores: bool = False  # score columns hold the logits instead of probabilities
    # multiple-choice tasks read their context from text_field and their choices here (a list; in CSV a JSON array)
    choices_field: str = "choices"
    question_field: str = "question"  # question-answering tasks read these two
    context_field: str = "context"
    # the heads' options, as on POST /v1/classify (None: the default); each must be read by one of the tasks
    aggregation_strategy: str | None = None
    top_k: int | None = None
    max_answer_len: int | None = None
    handle_impossible_answer: bool | None = None
    doc_stride: int | None = None

    def __post_init__(self) -> None:
        self.head_options()  # an unknown strategy, a value out of range: refused before anything is read
        if self.truncation_direction not in TRUNCATION_DIRECTIONS:
            raise InputError(
                f"--truncation-direction '{self.truncation_direction}' is not known; allowed: {', '.join(TRUNCATION_DIRECTIONS)}"
            )
        for name in ("batch_size", "chunk_size", "max_row_bytes", "threads", "ray_actors"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if not self.text_field:
            raise InputError("--text-field must name a field")
        if self.pair_field == self.text_field:
            raise InputError(f"--pair-field must differ from --text-field, both are '{self.text_field}'")
        if self.ray_actors is not None and not self.uses_ray:
            raise InputError("--ray-actors needs --ray or --ray-address")
        if not self.tasks:
            raise InputError("--task: name at least one task")
        repeated = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if repeated:
            raise InputError(f"--task: {', '.join(map(repr, repeated))} named more than once")

    def head_options(self) -> HeadOptions:
        """The options for the tasks' heads; raises InputError naming the option (as --aggregation-strategy ...)."""
        try:
            return HeadOptions(self.aggregation_strategy, self.top_k, self.max_answer_len, self.handle_impossible_answer,
                               self.doc_stride)  # fmt: skip
        except InputError as exc:
            raise as_flag(exc) from None

    @property
    def fields(self) -> InputFields:
        """Where a row holds each part of an input."""
        return InputFields(self.text_field, self.pair_field, self.choices_field, self.question_field, self.context_field)

    @property
    def tasks(self) -> tuple[str, ...]:
        return (self.task,) if isinstance(self.task, str) else tuple(self.task)

    @property
    def output_path(self) -> Path:
        return self.output if self.output is not None else self.input.with_name(f"{self.input.stem}.scored{self.input.suffix}")

    @property
    def uses_ray(self) -> bool:
        return self.ray or self.ray_address is not None
