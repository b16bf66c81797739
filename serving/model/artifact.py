"""The artifact folder: the contract between export (torch) and serving (no torch).

    model.onnx (+ model.onnx.data when large)   one graph for every task
    tokenizer.json (+ the base model's other tokenizer files)
    manifest.json                               what is in it, how it was made, and checksums of every file

Reading an artifact checks the manifest and every checksum, so a tampered or half-copied folder fails with an
error naming the file instead of serving wrong answers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionserve.errors import FusionServeError

from . import revisions

FORMAT = "fusionserve-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
# the graph's precision: fp16 for GPU; int8 (ONNX Runtime) and bf16 (OpenVINO, CPUs with bf16 units) for CPU
PRECISIONS = ("fp32", "fp16", "int8", "bf16")
_REQUIRED = ("format", "format_version", "fusionserve_version", "precision", "opset", "max_seq_len", "inputs",
             "outputs", "tokenizer", "adapters", "adapters_per_layer", "tasks", "files", "parity", "sources")  # fmt: skip


class ArtifactError(FusionServeError):
    """The artifact folder is missing files, was changed after export, or is not an artifact at all."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


TOKEN_HEADS = ("tagging", "question_answering")  # heads over every token's final state: the graph's token_logits


@dataclass(frozen=True)
class TaskEntry:
    name: str
    index: int  # the value of the graph's task_id input
    kind: str  # fusion | adapter | head
    labels: tuple[str, ...]
    adapters: tuple[str, ...]  # fusion: in the fusion's order
    adapters_per_layer: tuple[tuple[str, ...], ...] = ()  # per layer, which of them act there
    # classification | regression | multiple_choice | tagging | question_answering; "" (a manifest written before heads
    # had kinds): classification, or regression for a head with one label
    head: str = ""
    num_choices: int | None = None  # multiple choice: the count AdapterHub trained with (information, not a limit)

    def __post_init__(self) -> None:
        if not self.head:
            object.__setattr__(self, "head", "regression" if len(self.labels) == 1 else "classification")

    @property
    def level(self) -> str:
        """ "token" for a head over every token's final state (tagging, question answering), else "sequence"."""
        return "token" if self.head in TOKEN_HEADS else "sequence"


@dataclass(frozen=True)
class Artifact:
    """An artifact as one revision sees it: a live artifact's tasks are its revision's (``revisions.py``)."""

    folder: Path
    manifest: dict[str, Any]
    tasks: dict[str, TaskEntry]
    revision: int | None = None  # None: not live (the tasks are baked into the graph)
    task_files: dict[str, tuple[str, str]] = field(default_factory=dict)  # live: task -> (file, sha256)

    @property
    def model_path(self) -> Path:
        return self.folder / MODEL_FILE

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / TOKENIZER_FILE

    @property
    def adapters(self) -> tuple[str, ...]:
        """Columns of the graph's fusion_activations output."""
        return tuple(self.manifest["adapters"])

    @property
    def max_seq_len(self) -> int:
        return int(self.manifest["max_seq_len"])

    @property
    def pad_token(self) -> str:
        return str(self.manifest["tokenizer"]["pad_token"])

    def task(self, name: str) -> TaskEntry:
        """The task called ``name``; raises ArtifactError naming the known tasks."""
        if name not in self.tasks:
            raise ArtifactError(f"unknown task '{name}'; known tasks: {', '.join(self.tasks)}")
        return self.tasks[name]


def is_artifact(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def load_artifact(folder: str | Path, verify: bool = True, revision: int | None = None) -> Artifact:
    """Read and check an artifact folder; a live one at ``revision`` (default: the one published). Raises
    ArtifactError naming the file and what is wrong (RevisionError for a live artifact's revision files)."""
    folder = Path(folder).resolve()
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ArtifactError(f"artifact folder not found: {folder}")
    if not path.is_file():
        raise ArtifactError(f"{folder}: no {MANIFEST}; is this a folder written by `fusionserve export`?")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: field 'format' must be '{FORMAT}'")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise ArtifactError(f"{path}: missing field(s) {missing}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: format_version {manifest['format_version']!r} is not supported; this fusionserve reads {FORMAT_VERSION}"
        )
    files = manifest["files"]
    if not isinstance(files, dict) or MODEL_FILE not in files or TOKENIZER_FILE not in files:
        raise ArtifactError(f"{path}: field 'files' must list {MODEL_FILE} and {TOKENIZER_FILE} with their sha256")
    for name, digest in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ArtifactError(
                f"{path}: field 'files' lists {str(name)[:200]!r}, which is not a file name of the artifact folder; "
                "entries name files in the folder itself (no folders, no '..', no absolute paths)"
            )
        f = folder / name
        if not f.is_file():
            raise ArtifactError(f"{folder}: {name} is missing (the manifest lists it)")
        if verify and sha256(f) != digest:
            raise ArtifactError(f"{f}: checksum differs from the manifest; the file was changed after export")
    if not revisions.is_live(folder):
        return Artifact(folder, manifest, task_entries(manifest["tasks"], path))
    number = revisions.current(folder) if revision is None else revision
    doc = revisions.read(folder, number)
    files = {name: (t["file"], t["sha256"]) for name, t in doc["tasks"].items()}
    return Artifact(folder, manifest, task_entries(doc["tasks"], revisions.revision_path(folder, number)), number, files)


def task_entries(tasks: Any, path: Path) -> dict[str, TaskEntry]:
    """The tasks of a manifest (or of a revision) by name; raises ArtifactError naming ``path`` when malformed."""
    entries = {}
    try:
        for name, t in tasks.items():
            per_layer = tuple(tuple(layer) for layer in t.get("adapters_per_layer", ()))
            choices = None if t.get("num_choices") is None else int(t["num_choices"])
            entries[name] = TaskEntry(name, int(t["index"]), str(t["kind"]), tuple(t["labels"]), tuple(t["adapters"]), per_layer,
                                      str(t.get("head") or ""), choices)  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"{path}: field 'tasks' is malformed ({exc!r})") from None
    if not entries:
        raise ArtifactError(f"{path}: field 'tasks' is empty")
    if sorted(e.index for e in entries.values()) != list(range(len(entries))):
        raise ArtifactError(f"{path}: field 'tasks': the indices must be 0..{len(entries) - 1}, each once")
    return entries


def check_task(artifact: Artifact, name: str, what: str) -> None:
    """Raise ArtifactError unless ``name`` is a task of ``artifact``, naming ``what`` asked for it (an option) and the
    tasks there are."""
    if name not in artifact.tasks:
        raise ArtifactError(f"{what} '{name}' is not a task of {artifact.folder}; known tasks: {', '.join(artifact.tasks)}")


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Add checksums of every file in ``folder`` (but the manifest) and write manifest.json last; returns what it wrote."""
    manifest = dict(manifest)
    manifest["files"] = {p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest["format"], manifest["format_version"] = FORMAT, FORMAT_VERSION
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def render_manifest(manifest: dict[str, Any]) -> str:
    """An artifact's manifest as text for a terminal."""
    base = manifest.get("base_model", {})
    parity = manifest["parity"]
    lines = [
        f"artifact    fusionserve {manifest['fusionserve_version']}, {manifest['precision']}, opset {manifest['opset']}, "
        f"max {manifest['max_seq_len']} tokens",
        f"base model  {base.get('architecture', 'bert')}, {base.get('layers')} layers, hidden {base.get('hidden_size')}, "
        f"{base.get('attention_heads')} heads",
        "parity      max |diff| vs PyTorch: "
        + ", ".join(f"{k} {v:.2g}" for k, v in parity["max_abs_diff"].items())
        + f" over {parity['cases']} cases (tolerance {parity['tolerance']['logits']:g})"
        + (f", of the {parity['precision']} graph before quantization" if "int8" in manifest else "")
        + (f", of the {parity['precision']} graph OpenVINO compiles in bf16" if "bf16" in manifest else ""),
        *render_int8(manifest.get("int8")),
        *render_bf16(manifest.get("bf16")),
        f"fused ops   {manifest.get('fused_operators', {}).get('summary', '?')}",
        "adapters per layer",
    ]
    # Houlsby adapters fuse after the attention block too: two fusion layers per layer, 'L3a' and 'L3'
    sites = manifest.get("fusion_layers") or []
    if any(site["place"] == "attention" for site in sites):
        lines[-1] = "adapters per fusion layer (La: after layer L's attention block, L: after its FFN)"
    for i, stack in enumerate(manifest["adapters_per_layer"]):
        name = f"L{sites[i]['layer']}{'a' if sites[i]['place'] == 'attention' else ''}" if len(sites) > i else f"L{i}"
        lines.append(f"  {name}: {', '.join(stack) or '-'}")
    lines.append("tasks")
    width = max(16, *(len(name) for name in manifest["tasks"]))
    for name, t in manifest["tasks"].items():
        what = {
            "fusion": "fusion over " + ", ".join(t["adapters"]),
            "adapter": f"adapter {', '.join(t['adapters'])}",
            "head": "head only",
        }
        lines.append(f"  {name:<{width}} {what.get(t['kind'], t['kind'])}; {describe_head(t)}")
    pruning = manifest.get("pruning")
    if pruning:
        lines.append(f"pruned      {pruning['rule']['summary']} (activations: {pruning['stats']['path']})")
        for task, t in pruning["tasks"].items():
            for layer, kept in enumerate(t["kept_per_layer"]):
                lines.append(f"  {task} L{layer}: {', '.join(kept) or '- (fusion dropped)'}")
    return "\n".join(lines)


def describe_head(task: dict[str, Any]) -> str:
    """A task's head (a manifest's or a revision's task entry) for a terminal: its kind beyond classification, and its
    labels where it has label names."""
    entry = task_entries({"t": {**task, "index": 0}}, Path(MANIFEST))["t"]
    if entry.head == "regression":
        return "head regression (one value)"
    if entry.head == "multiple_choice":
        trained = f", trained on {entry.num_choices} choices" if entry.num_choices else ""
        return f"head multiple_choice (one logit per (context, choice) row{trained})"
    if entry.head == "question_answering":
        return "head question_answering (start and end logits per token)"
    labels = f"labels: {', '.join(entry.labels)}"
    return f"head tagging (per token); {labels}" if entry.head == "tagging" else labels  # classification: as ever


def render_int8(record: dict[str, Any] | None) -> list[str]:
    """An int8 artifact's gate figures and what was quantized, as lines for a terminal (none for other precisions)."""
    if not record:
        return []
    gate, limits, q = record["gate"], record["gate"]["thresholds"], record["quantization"]
    size = record["model_bytes"]
    kept = ", ".join(f"{op} {k['count']}" for op, k in q["kept_fp32"].items())
    return [
        f"int8 gate   vs the fp32 graph over {gate['rows']} rows ({gate['cases']} cases): label agreement "
        f"{gate['label_agreement']:.2%} (min {limits['min_label_agreement']:.0%}), max probability change "
        f"{gate['max_probability_change']:.3f} (max {limits['max_probability_change']:g}); fusion activations max change "
        f"{gate['max_fusion_activation_change']:.3f} (recorded)",
        "int8        quantized "
        + ", ".join(f"{op} {n}/{q['of'][op]}" for op, n in q["quantized"].items())
        + f" ({q['weights']}); fp32: {kept}; model.onnx {size['int8'] / 2**20:.1f} MB (fp32 {size['fp32'] / 2**20:.1f} MB)",
        *_render_heads(gate),
        f"int8        activations: {q['activations']}",
        *_render_smoothing(record.get("smoothing")),
    ]


def _render_heads(gate: dict[str, Any]) -> list[str]:
    """The int8 gate's figures of each head kind beyond classification (none for older artifacts)."""
    limits, lines = gate["thresholds"], []
    for kind, f in gate.get("heads", {}).items():
        if kind == "regression":
            lines.append(
                f"int8 gate   regression: correlation with fp32 {f['correlation']:.4f} over {f['rows']} rows "
                f"(min {limits['min_regression_correlation']:g}), max value change {f['max_abs_change']:.3g}"
            )
        else:
            lines.append(
                f"int8 gate   {kind}: agreement {f['agreement']:.2%} over {f['count']} {f['units']} "
                f"(min {limits['min_label_agreement']:.0%}), max probability change {f['max_probability_change']:.3f}"
            )
    return lines


def render_bf16(record: dict[str, Any] | None) -> list[str]:
    """A bf16 artifact's gate figures and what ran them, as lines for a terminal (none for other precisions)."""
    if not record:
        return []
    gate, limits, rt = record["gate"], record["gate"]["thresholds"], record["runtime"]
    units = ", ".join(rt["cpu_bf16_units"]) or "none: bf16 emulated with AVX-512"
    return [
        f"bf16 gate   vs the fp32 graph over {gate['rows']} rows ({gate['cases']} cases): label agreement "
        f"{gate['label_agreement']:.2%} (min {limits['min_label_agreement']:.0%}), max logit change "
        f"{gate['max_logit_change']:.3f} (max {limits['max_logit_change']:g}); fusion activations max change "
        f"{gate['max_fusion_activation_change']:.3f} (recorded)",
        f"bf16        runs with OpenVINO's CPU plugin (checked with OpenVINO {rt['version']}, inference precision "
        f"{rt['inference_precision']}; bf16 units: {units})",
    ]


def _render_smoothing(smooth: dict[str, Any] | None) -> list[str]:
    """The SmoothQuant line of an int8 artifact that was smoothed before quantizing (none otherwise)."""
    if not smooth:
        return []
    cal = smooth["calibration"]
    return [
        f"int8 smooth alpha {smooth['alpha']:g} over {smooth['gemms']} GEMMs (inverse in V columns "
        f"{smooth['inverse_in_v_columns']}, as a Mul {smooth['inverse_as_mul']}; largest scale {smooth['largest_scale']:g}), "
        f"calibrated on {cal['rows']} rows of {cal['source']}; smoothed fp32 vs fp32 max |diff| "
        f"{smooth['fp32_max_abs_diff']:.2g}"
    ]
