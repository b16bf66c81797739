from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Input(_message.Message):
    __slots__ = ("text", "text_pair", "choices", "question", "context")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_PAIR_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    text_pair: str
    choices: _containers.RepeatedScalarFieldContainer[str]
    question: str
    context: str
    def __init__(self, text: _Optional[str] = ..., text_pair: _Optional[str] = ..., choices: _Optional[_Iterable[str]] = ..., question: _Optional[str] = ..., context: _Optional[str] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("task", "inputs", "return_fusion_activations", "strict", "tasks", "raw_scores", "truncation_direction", "timeout_ms", "aggregation_strategy", "top_k", "max_answer_len", "handle_impossible_answer", "doc_stride")
    TASK_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FUSION_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_ANSWER_LEN_FIELD_NUMBER: _ClassVar[int]
    HANDLE_IMPOSSIBLE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    DOC_STRIDE_FIELD_NUMBER: _ClassVar[int]
    task: str
    inputs: _containers.RepeatedCompositeFieldContainer[Input]
    return_fusion_activations: bool
    strict: bool
    tasks: _containers.RepeatedScalarFieldContainer[str]
    raw_scores: bool
    truncation_direction: str
    timeout_ms: int
    aggregation_strategy: str
    top_k: int
    max_answer_len: int
    handle_impossible_answer: bool
    doc_stride: int
    def __init__(self, task: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Input, _Mapping]]] = ..., return_fusion_activations: _Optional[bool] = ..., strict: _Optional[bool] = ..., tasks: _Optional[_Iterable[str]] = ..., raw_scores: _Optional[bool] = ..., truncation_direction: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., aggregation_strategy: _Optional[str] = ..., top_k: _Optional[int] = ..., max_answer_len: _Optional[int] = ..., handle_impossible_answer: _Optional[bool] = ..., doc_stride: _Optional[int] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("label", "score", "scores", "truncated", "choice", "tokens", "entities", "answers")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENTITIES_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    scores: _containers.RepeatedScalarFieldContainer[float]
    truncated: bool
    choice: int
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    entities: _containers.RepeatedCompositeFieldContainer[Entity]
    answers: _containers.RepeatedCompositeFieldContainer[Answer]
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ..., scores: _Optional[_Iterable[float]] = ..., truncated: _Optional[bool] = ..., choice: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., entities: _Optional[_Iterable[_Union[Entity, _Mapping]]] = ..., answers: _Optional[_Iterable[_Union[Answer, _Mapping]]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("entity", "score", "index", "word", "start", "end", "scores")
    ENTITY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    entity: str
    score: float
    index: int
    word: str
    start: int
    end: int
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, entity: _Optional[str] = ..., score: _Optional[float] = ..., index: _Optional[int] = ..., word: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class Entity(_message.Message):
    __slots__ = ("entity_group", "score", "word", "start", "end")
    ENTITY_GROUP_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    entity_group: str
    score: float
    word: str
    start: int
    end: int
    def __init__(self, entity_group: _Optional[str] = ..., score: _Optional[float] = ..., word: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("answer", "score", "start", "end")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    answer: str
    score: float
    start: int
    end: int
    def __init__(self, answer: _Optional[str] = ..., score: _Optional[float] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class FusionActivations(_message.Message):
    __slots__ = ("adapters", "layers", "values")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    layers: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, adapters: _Optional[_Iterable[str]] = ..., layers: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class TaskAnswer(_message.Message):
    __slots__ = ("task", "labels", "predictions", "fusion_activations")
    TASK_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    FUSION_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    task: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    fusion_activations: FusionActivations
    def __init__(self, task: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., fusion_activations: _Optional[_Union[FusionActivations, _Mapping]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("task", "labels", "predictions", "fusion_activations", "results")
    TASK_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    FUSION_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    task: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    fusion_activations: FusionActivations
    results: _containers.RepeatedCompositeFieldContainer[TaskAnswer]
    def __init__(self, task: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., fusion_activations: _Optional[_Union[FusionActivations, _Mapping]] = ..., results: _Optional[_Iterable[_Union[TaskAnswer, _Mapping]]] = ...) -> None: ...
