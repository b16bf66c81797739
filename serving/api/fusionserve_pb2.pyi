from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Input(_message.Message):
    __slots__ = ("text", "text_pair")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_PAIR_FIELD_NUMBER: _ClassVar[int]
    text: str
    text_pair: str
    def __init__(self, text: _Optional[str] = ..., text_pair: _Optional[str] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("task", "inputs", "return_fusion_activations", "strict", "tasks", "raw_scores", "truncation_direction", "timeout_ms")
    TASK_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FUSION_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    task: str
    inputs: _containers.RepeatedCompositeFieldContainer[Input]
    return_fusion_activations: bool
    strict: bool
    tasks: _containers.RepeatedScalarFieldContainer[str]
    raw_scores: bool
    truncation_direction: str
    timeout_ms: int
    def __init__(self, task: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Input, _Mapping]]] = ..., return_fusion_activations: _Optional[bool] = ..., strict: _Optional[bool] = ..., tasks: _Optional[_Iterable[str]] = ..., raw_scores: _Optional[bool] = ..., truncation_direction: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("label", "score", "scores", "truncated")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    scores: _containers.RepeatedScalarFieldContainer[float]
    truncated: bool
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ..., scores: _Optional[_Iterable[float]] = ..., truncated: _Optional[bool] = ...) -> None: ...

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
