"""Prometheus metrics (``fusionserve_`` prefix, units in names, counters end in ``_total``).

Each replica is its own process. When ``PROMETHEUS_MULTIPROC_DIR`` is set (``fusionserve serve`` sets it for its
replicas), every replica writes its samples there and ``/metrics`` on any replica answers for all replicas on
that node (prometheus_client's multiprocess mode); otherwise a replica reports itself. The mean fusion activation
is computed at scrape time from two counters, so it is exact across replicas too. Everything is recorded once per
batch, not per request; the activation sums (one counter per task, layer and adapter) are added up in memory and
written out every second, so another replica's last second may be missing from a scrape, never lost.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from ..scheduler.batching import BatchStats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536)
_TASK_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
FLUSH_S = 1.0  # the activation counters lag the served inputs by at most this (other replicas' sums, at a scrape)
_ACT_SUM = "fusionserve_fusion_activation_weight_sum"
_ACT_INPUTS = "fusionserve_fusion_activation_inputs"


METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess folder, in each replica's environment


def _multiproc_dir() -> str | None:
    path = os.environ.get(METRICS_ENV)
    return path if path and os.path.isdir(path) else None


class _ActivationMeans:
    """Collector: fusionserve_fusion_activation_mean_ratio = weight sum / inputs, per task, layer and adapter."""

    def __init__(self, source: CollectorRegistry | MultiProcessCollector) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        sums: dict[tuple[str, str, str], float] = {}
        inputs: dict[str, float] = {}
        for fam in self.source.collect():
            for s in fam.samples:
                if s.name == f"{_ACT_SUM}_total":
                    sums[(s.labels["task"], s.labels["layer"], s.labels["adapter"])] = s.value
                elif s.name == f"{_ACT_INPUTS}_total":
                    inputs[s.labels["task"]] = s.value
        mean = GaugeMetricFamily(
            "fusionserve_fusion_activation_mean_ratio",
            "Mean fusion softmax weight of an adapter in a layer over all inputs served (each input averaged over its tokens)",
            labels=["task", "layer", "adapter"],
        )
        for (task, layer, adapter), total in sorted(sums.items()):
            if inputs.get(task):
                mean.add_metric([task, layer, adapter], total / inputs[task])
        yield mean


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "fusionserve_request_duration_seconds", "Time from request received to answer, by task and HTTP status",
            ["task", "status"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "fusionserve_queue_wait_seconds", "Time a request waited in its task's batch queue",
            ["task"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.model_duration = Histogram(
            "fusionserve_model_duration_seconds", "Time of one batched model call (padding + ONNX Runtime)",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "fusionserve_batch_size_inputs", "Inputs (rows) per model call, of any tasks", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "fusionserve_batch_tokens", "Tokens per model call (batch x padded length)", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_tasks = Histogram(
            "fusionserve_batch_tasks",
            "Different tasks in one model call: how much batches mix",
            buckets=_TASK_BUCKETS,
            registry=r,
        )
        self.inputs = Counter(
            "fusionserve_inputs_total", "Rows the model ran: an input, a choice of a multiple-choice input, a window of a QA context",
            ["task"], registry=r,
        )  # fmt: skip
        self.truncated = Counter("fusionserve_truncated_inputs_total", "Inputs cut to the token limit", ["task"], registry=r)
        self.rejected = Counter(
            "fusionserve_rejected_requests_total", "Requests refused before the model, by reason", ["reason"], registry=r
        )
        self.dropped = Counter(
            "fusionserve_dropped_requests_total",
            "Requests dropped before the model ran them, by reason: deadline_exceeded (still waiting at their deadline), "
            "client_disconnected (their caller went away; rows already in a running batch finish)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.act_sum = Counter(
            f"{_ACT_SUM}_total", "Sum over served inputs of an adapter's mean fusion weight in a layer",
            ["task", "layer", "adapter"], registry=r,
        )  # fmt: skip
        self.act_inputs = Counter(f"{_ACT_INPUTS}_total", "Inputs whose fusion weights were summed", ["task"], registry=r)
        self.revision = Gauge(
            "fusionserve_artifact_revision", "Revision of the live artifact a replica serves (-1: not a live artifact)",
            multiprocess_mode="liveall", registry=r,
        )  # fmt: skip
        self.revision_loads = Counter(
            "fusionserve_revision_loads_total", "Revisions a replica loaded after it started, by result", ["result"], registry=r
        )

        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self._acts: dict[tuple[str, tuple[str, ...]], list[Any]] = {}  # (task, adapters) -> [sums (layers, adapters), inputs]
        self._acts_lock = threading.Lock()
        self._flusher: threading.Thread | None = None

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: prometheus_client locks and builds a key on every call."""
        if not labels:  # an unlabelled metric is its own child
            return metric
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_request(self, task: str, status: int, seconds: float, queue_ms: float | None = None) -> None:
        """One answered request: its duration by status, and for a classified one its wait for the model."""
        self._child(self.request_duration, task, str(status)).observe(seconds)
        if queue_ms is not None:
            self._child(self.queue_wait, task).observe(queue_ms / 1000)

    def observe_rejected(self, reason: str) -> None:
        self._child(self.rejected, reason).inc()

    def observe_dropped(self, reason: str) -> None:
        self._child(self.dropped, reason).inc()

    def observe_batch(self, batch: BatchStats) -> None:
        """One model call: called once per batch, not per request. A batch may mix tasks: its size, tokens, time and
        mix are the batch's; inputs, truncations and activations are counted per task, the activations under the
        adapter names of the revision the batch ran on. The activation sums (a counter per task, layer and adapter)
        are added up here and written out at most every ``FLUSH_S`` seconds, and at every scrape."""
        self._child(self.model_duration).observe(batch.model_ms / 1000)
        self._child(self.batch_size).observe(batch.inputs)
        self._child(self.batch_tokens).observe(batch.tokens)
        self._child(self.batch_tasks).observe(len(batch.tasks))
        for task, share in batch.tasks.items():
            self._child(self.inputs, task).inc(share.inputs)
            if share.truncated:
                self._child(self.truncated, task).inc(share.truncated)
            if share.activation_sums is None:
                continue
            with self._acts_lock:  # (layers, adapters), summed over the task's inputs in the batch
                slot = self._acts.setdefault((task, share.adapters), [0.0, 0])
                slot[0] = slot[0] + share.activation_sums
                slot[1] += share.inputs
                if self._flusher is None:
                    self._flusher = threading.Thread(target=self._flush_forever, name="fusionserve-metrics", daemon=True)
                    self._flusher.start()

    def flush(self) -> None:
        """Write the activation sums added up since the last flush into their counters."""
        with self._acts_lock:
            pending, self._acts = self._acts, {}
        for (task, adapters), (sums, inputs) in pending.items():
            for layer, row in enumerate(sums.tolist()):
                for adapter, value in zip(adapters, row, strict=True):
                    self._child(self.act_sum, task, str(layer), adapter).inc(value)
            self._child(self.act_inputs, task).inc(inputs)

    def _flush_forever(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            self.flush()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape."""
        self.flush()
        out = CollectorRegistry()
        path = _multiproc_dir()
        if path is None:
            out.register(self.registry)  # type: ignore[arg-type]
            out.register(_ActivationMeans(self.registry))  # type: ignore[arg-type]
        else:
            MultiProcessCollector(out, path)
            out.register(_ActivationMeans(MultiProcessCollector(None, path)))  # type: ignore[arg-type]
        return generate_latest(out), CONTENT_TYPE_LATEST
