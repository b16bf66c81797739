"""Prometheus metrics of the HTTP ingress (one registry, ``fusionserve_`` prefix, units in names, counters end
in ``_total``). Batch-level figures come back from the model replicas with each answer and are counted once
per batch (the replica marks one answer of each batch to carry them)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .batching import JobResult

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "fusionserve_request_duration_seconds", "Time from request received to answer, by task and HTTP status",
            ["task", "status"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "fusionserve_queue_wait_seconds", "Time a request waited in its task's batch queue on the model replica",
            ["task"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.model_duration = Histogram(
            "fusionserve_model_duration_seconds", "Time of one batched model call (tokenize + ONNX Runtime)",
            ["task"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "fusionserve_batch_size_inputs", "Inputs per model call", ["task"], buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "fusionserve_batch_tokens",
            "Tokens per model call (batch x padded length)",
            ["task"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.inputs = Counter("fusionserve_inputs_total", "Inputs classified", ["task"], registry=r)
        self.truncated = Counter("fusionserve_truncated_inputs_total", "Inputs cut to the token limit", ["task"], registry=r)
        self.rejected = Counter(
            "fusionserve_rejected_requests_total", "Requests refused before the model, by reason", ["reason"], registry=r
        )
        self.activation_mean = Gauge(
            "fusionserve_fusion_activation_mean_ratio",
            "Mean fusion softmax weight of an adapter in a layer over all inputs served (averaged over each input's tokens)",
            ["task", "layer", "adapter"], registry=r,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._act_sum: dict[tuple[str, int, str], float] = {}
        self._act_n: dict[str, int] = {}

    def observe_result(self, task: str, result: JobResult, adapters: tuple[str, ...]) -> None:
        n = len(result.logits)
        self.inputs.labels(task).inc(n)
        self.truncated.labels(task).inc(sum(result.truncated))
        self.queue_wait.labels(task).observe(result.queue_ms / 1000)
        if result.batch.report:
            self.model_duration.labels(task).observe(result.batch.model_ms / 1000)
            self.batch_size.labels(task).observe(result.batch.inputs)
            self.batch_tokens.labels(task).observe(result.batch.tokens)
        if result.activations:
            with self._lock:
                total = self._act_n.get(task, 0) + n
                self._act_n[task] = total
                for per_input in result.activations:
                    for layer, row in enumerate(per_input):
                        for adapter, value in zip(adapters, row, strict=True):
                            key = (task, layer, adapter)
                            self._act_sum[key] = self._act_sum.get(key, 0.0) + value
                for (t, layer, adapter), s in self._act_sum.items():
                    if t == task:
                        self.activation_mean.labels(task, str(layer), adapter).set(s / total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
