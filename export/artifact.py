"""``fusionserve export``: spec -> validated artifact folder (see serving/model/artifact.py for the format).

The artifact is built in a temporary folder beside the target and moved into place only after ONNX Runtime
matched PyTorch on every task: a failed export leaves nothing behind."""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fusionserve import __version__
from fusionserve.errors import FusionServeError
from fusionserve.serving.model.artifact import MODEL_FILE, PRECISIONS, TOKENIZER_FILE, sha256, write_manifest
from fusionserve.serving.model.runtime import make_session
from fusionserve.serving.model.tables import WithTables, stack, table_specs
from fusionserve.serving.model.tokenize import Encoder

from .bf16 import Bf16Gate, Bf16GateError, bf16_graph
from .build import Dropped
from .int8.quantize import DEFAULT_OPTIONS, Int8Options, int8_graph
from .int8.rowwise import MIN_OPSET as ROW_MIN_OPSET
from .live.tables import graph_tables, write_first_revision
from .model import FusionModel
from .onnx_export import DEFAULT_OPSET, OPSETS, FusionReport, export_raw, optimize
from .spec import ModelSpec, load_spec
from .tokenizer import load_tokenizer, max_length
from .validate import GRIDS, Remembered, check_parity, count_cases


def _source_checksums(spec: ModelSpec) -> dict[str, Any]:
    root = spec.path.parent
    folders = {spec.base_model, *spec.adapters.values()}
    for t in spec.tasks.values():
        folders |= {t.head} | ({t.fusion} if t.fusion else set())
    files = {}
    for folder in sorted(folders):
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = str(f.relative_to(root)) if f.is_relative_to(root) else str(f)
            files[name] = sha256(f)
    return {"spec": {"path": str(spec.path), "sha256": sha256(spec.path)}, "files": files}


def _manifest(
    spec: ModelSpec, model: FusionModel, precision: str, opset: int, max_seq_len: int, pad_token: str, inputs: list[str]
) -> dict[str, Any]:
    bb = model.backbone
    stacks = [list(stack) for stack in model.stacks]
    described = {
        "input_ids": "int64 (batch, sequence)",
        "attention_mask": "int64 (batch, sequence)",
        "token_type_ids": "int64 (batch, sequence)",
        "task_id": "int64 (1,): the task's index for every row, or (batch,): each row's task",
    }
    return {
        "fusionserve_version": __version__,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "precision": precision,
        "opset": opset,
        "max_seq_len": max_seq_len,
        "inputs": {name: described[name] for name in inputs},
        "outputs": _outputs(model),
        "tokenizer": {"file": TOKENIZER_FILE, "pad_token": pad_token, "max_length": max_seq_len},
        "base_model": {
            "architecture": bb.arch.name,
            "layers": bb.n_layers,
            "hidden_size": bb.hidden_size,
            "attention_heads": bb.n_heads,
            "vocab_size": bb.vocab_size,
        },
        "fusion_layers": [{"layer": site.layer, "place": site.place} for site in model.sites],
        "adapters": list(model.adapter_names),
        "adapters_per_layer": stacks,
        "tasks": {name: {"index": model.task_index[name], **info.manifest_entry()} for name, info in model.infos.items()},
        "sources": _source_checksums(spec),
    }


def _outputs(model: FusionModel) -> dict[str, str]:
    """What each of the graph's outputs holds."""
    described = {
        "logits": f"float32 (batch, {model.max_labels}): the row's sequence-level head (classification, regression, "
        "multiple choice); the first len(labels) columns are the task's",
        "fusion_activations": f"float32 (batch, {len(model.sites)}, sequence, {len(model.adapter_names)}): "
        "softmax weight of each adapter (columns: 'adapters') per fusion layer (rows: 'fusion_layers') and token",
        "token_logits": f"float32 (batch, sequence, {model.token_width}): the row's token-level head (tagging, question "
        "answering) on every token; the first len(labels) columns are the task's",
    }
    return {name: described[name] for name in model.outputs}


def _check_options(precision: str, opset: int, out: Path, force: bool, parity_grid: str) -> None:
    if parity_grid not in GRIDS:
        raise FusionServeError(f"--parity-grid must be one of {', '.join(GRIDS)}, got '{parity_grid}'")
    if precision not in PRECISIONS:
        raise FusionServeError(f"--precision must be one of {', '.join(PRECISIONS)}, got '{precision}'")
    if precision == "bf16":  # before anything is built: the bf16 gate runs the graph with OpenVINO, in bf16
        from fusionserve.serving.model.openvino_runtime import require_bf16_here

        require_bf16_here(Bf16GateError)
    if opset not in OPSETS:
        raise FusionServeError(f"--opset must be between {OPSETS[0]} and {OPSETS[-1]}, got {opset}")
    if precision == "int8" and opset < ROW_MIN_OPSET:
        raise FusionServeError(
            f"--precision int8 needs --opset {ROW_MIN_OPSET} to {OPSETS[-1]} (its per-row quantization takes one scale per "
            f"row, QuantizeLinear's axis, from opset {ROW_MIN_OPSET}), got {opset}"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FusionServeError(f"{out} exists and is not empty; pass --force to replace it")


def _check_out_holds_no_input(spec: ModelSpec, out: Path) -> None:
    """``--out`` is replaced (with --force) by the artifact: it must not be, or hold, the spec or a folder it reads.
    Raises FusionServeError naming both."""
    for task in spec.tasks.values():
        for path in (spec.path, spec.base_model, *spec.adapters.values(), task.head, task.fusion):
            if path is not None and path.is_relative_to(out):
                raise FusionServeError(
                    f"--out {out} holds {path}, which the spec reads; the export would replace it: choose another folder"
                )


def _built(
    spec_path: str | Path, tasks: Sequence[str] | None, dropped: Dropped | None, max_seq_len: int | None, out: Path
) -> tuple[ModelSpec, FusionModel, Any, int]:
    """(spec, folded model, base tokenizer, token limit): the limit asked for, checked, or the tokenizer's."""
    spec = load_spec(spec_path)
    _check_out_holds_no_input(spec, out)
    if tasks:
        spec = spec.select(tasks)
    from .build import build_model

    model = build_model(spec, dropped)
    tok = load_tokenizer(spec.base_model)
    limit = max_length(tok, model)
    if max_seq_len is None:
        max_seq_len = spec.max_seq_len or limit  # one default: the spec's, else the tokenizer's
    if not 8 <= max_seq_len <= model.backbone.max_tokens:
        raise FusionServeError(
            f"--max-seq-len must be between 8 and {model.backbone.max_tokens} (the model's positions), got {max_seq_len}"
        )
    return spec, model, tok, max_seq_len


class _Steps:
    """One progress line for the export's steps (six; int8 adds quantizing and its gate)."""

    def __init__(self, progress: bool, steps: int = 6) -> None:
        self.progress = progress
        self.bar = tqdm(
            total=steps, desc="export", disable=not progress, file=sys.stderr, bar_format="{desc} [{n}/{total}, {elapsed}]"
        )

    def __call__(self, what: str) -> None:
        self.bar.set_description_str(f"export: {what}", refresh=False)
        self.bar.update(1)


def _validated_graph(
    work: Path,
    model: FusionModel,
    precision: str,
    opset: int,
    max_seq_len: int,
    step: _Steps,
    grid: str,
    int8: Int8Options,
    encoder: Any = None,
    live: bool = False,
) -> tuple[Any, FusionReport, Any, dict[str, Any] | None]:
    """Export, optimize and check the graph in ``work``; (session, fused-operator report, parity report, int8 or bf16
    record). int8 quantizes the fp32 graph once it matched PyTorch, then gates it against that graph; bf16 keeps the
    traced standard-op graph (no ONNX Runtime fusions: OpenVINO compiles it) and gates OpenVINO's bf16 against it.
    Raises ExportError, ParityError, Int8GateError or Bf16GateError."""
    raw = work / "raw.onnx"
    export_raw(model, raw, opset, live)
    step("ONNX exported")
    graph_precision = "fp32" if precision in ("int8", "bf16") else precision  # both start from the validated fp32 graph
    if precision == "bf16":
        report = _standard_ops(raw, work / MODEL_FILE, model)
    else:
        report = optimize(raw, work / MODEL_FILE, model, graph_precision)
    for extra in work.glob("raw.onnx*"):
        extra.unlink()
    step(f"optimized ({report.describe()})")
    if report.missing and precision != "bf16":
        print(f"fusionserve export: warning: {report.describe()}", file=sys.stderr)
    session = make_session(work / MODEL_FILE, device="cpu")
    tables = _live_tables(session, model) if live else None
    if tables is not None:  # a live graph (live.py): fed its own tasks' tables for the checks
        session = WithTables(session, tables)
    if precision in ("int8", "bf16"):  # their gates (and int8's smoothing check) run the fp32 graph on parity's feeds
        session = Remembered(session)
    cases = count_cases(model, max_seq_len, grid)
    with tqdm(total=cases, desc="validate", unit="case", disable=not step.progress, file=sys.stderr, leave=False) as bar:
        parity = check_parity(session, model, graph_precision, max_seq_len, progress=bar.update, grid=grid)
    step("validated: " + ", ".join(f"max |diff| {k} {v:.2g}" for k, v in parity.max_abs_diff.items() if k.endswith("logits")))
    if precision == "bf16":
        total = count_cases(model, max_seq_len)  # the gate runs the whole grid, as int8's
        with tqdm(total=total, desc="bf16 gate", unit="case", disable=not step.progress, file=sys.stderr, leave=False) as bar:
            session, record = bf16_graph(work / MODEL_FILE, session, model, max_seq_len, Bf16Gate(), bar.update)
        step(f"bf16 gate passed: label agreement {record['gate']['label_agreement']:.1%}")
        return session, report, parity, record
    if precision != "int8":
        return session, report, parity, None
    step("quantizing to int8")
    session, record = int8_graph(work, session, model, max_seq_len, int8, step.progress, encoder)
    step(f"int8 gate passed: label agreement {record['gate']['label_agreement']:.1%}")
    return session, report, parity, record


def _standard_ops(raw: Path, out: Path, model: FusionModel) -> FusionReport:
    """The traced graph as it is (bf16: OpenVINO reads standard operators and fuses them itself), moved to ``out`` with
    its external data file, if any, renamed to match; the report counts no fused operator and expects none."""
    import onnx

    graph = onnx.load(str(raw))
    onnx.save(graph, str(out), save_as_external_data=raw.stat().st_size > 1_800_000_000)
    return _Unfused({}, {})


class _Unfused(FusionReport):
    def describe(self) -> str:
        return "none: OpenVINO fuses the standard-op graph as it compiles it"


def _live_tables(session: Any, model: FusionModel) -> dict[str, Any]:
    specs = table_specs(session)
    return stack(graph_tables(model, specs), specs)


def _publish(work: Path, out: Path, manifest: dict[str, Any], step: _Steps) -> dict[str, Any]:
    """Write the manifest (last, with the checksums of the finished ``work`` folder), then put ``work`` in the place
    of ``out``, replacing what was there; returns the manifest as written."""
    manifest = write_manifest(work, manifest)
    step("manifest written")

    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    work.rename(out)
    step(f"written to {out}")
    return manifest


def export_artifact(
    spec_path: str | Path,
    out: str | Path,
    precision: str = "fp32",
    max_seq_len: int | None = None,
    opset: int = DEFAULT_OPSET,
    force: bool = False,
    progress: bool = True,
    tasks: Sequence[str] | None = None,
    dropped: Dropped | None = None,
    pruning: dict[str, Any] | None = None,
    parity_grid: str = "full",
    int8: Int8Options = DEFAULT_OPTIONS,
    live: bool = False,
) -> dict[str, Any]:
    """Export a spec to an artifact folder and return its manifest. ``tasks`` serves only those tasks of the spec;
    ``dropped`` prunes fusions (see ``build.build_model``) and ``pruning`` is recorded in the manifest with it;
    ``parity_grid`` is how much of the shape grid each task is checked on (see ``validate.GRIDS``);
    ``int8``: how precision 'int8' quantizes and the gate it must pass (see ``quantize``).

    Raises SpecError/CheckpointError (bad inputs), ExportError (export or optimizer failure), ParityError (ONNX
    Runtime disagrees with PyTorch beyond the tolerance), Int8GateError (the int8 graph departs from the fp32 one
    beyond the gate) or FusionServeError (bad options, existing folder). ``live``: tasks beside the graph (live.py)."""
    out = Path(out).resolve()
    _check_options(precision, opset, out, force, parity_grid)
    step = _Steps(progress, {"int8": 8, "bf16": 7}.get(precision, 6))
    try:
        spec, model, tok, max_seq_len = _built(spec_path, tasks, dropped, max_seq_len, out)
    except BaseException:  # the bar ends before the error is printed, not after it when the process exits
        step.bar.close()
        raise
    step("model built")

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the artifact is meant to be shared
    try:
        # int8's calibration file is tokenized as serving will tokenize
        encoder = Encoder(tok.backend_tokenizer, max_seq_len, str(tok.pad_token)) if int8.calibration else None
        session, report, parity, record = _validated_graph(
            work, model, precision, opset, max_seq_len, step, parity_grid, int8, encoder, live
        )
        tok.save_pretrained(str(work))
        if not (work / TOKENIZER_FILE).is_file():
            tok.backend_tokenizer.save(str(work / TOKENIZER_FILE))
        inputs = [i.name for i in session.get_inputs()]
        manifest = _manifest(spec, model, precision, opset, max_seq_len, str(tok.pad_token), inputs)
        manifest["fused_operators"] = {"found": report.counts, "expected": report.expected, "summary": report.describe()}
        manifest["parity"] = parity.as_dict()
        manifest |= {k: v for k, v in {precision: record, "pruning": pruning}.items() if v is not None}
        manifest["io"] = {"inputs": inputs, "outputs": list(model.outputs)}
        manifest |= {"live": write_first_revision(work, spec, model, session.session, manifest["parity"])} if live else {}
        manifest = _publish(work, out, manifest, step)
    finally:
        step.bar.close()
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return manifest
