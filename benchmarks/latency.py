"""In-process latency of the served graph against the plain backbone and against AdapterHub, side by side.

    python -m benchmarks.latency [--geometries minilm bert-base roberta-base] [--batches 1 16] [--seq 128] [--rounds-scale 1.0]
    python -m benchmarks.latency --int8 ...   # only what issue 13's targets compare, in its own section

Variants, all timed in one process, round-robin (each round runs every variant once, in a shuffled order, so
machine noise hits all of them alike); the median over rounds after warm-up is reported:

- ``plain (ORT)``: backbone + head only, exported by fusionserve (same runtime, same fusions)
- ``plain (PyTorch eager)``: the same backbone + head in PyTorch eager, to show what the runtime itself gives
- ``fusion N (ORT)``: fusionserve's graph with one AdapterFusion over N adapters, N = 2, 8, 16
- ``fusion N=8, 4 tasks (ORT)``: the same graph serving 4 fusion tasks, selected by the task_id input
- ``fusion N=8 int8 (ORT)``: the N=8 graph exported with ``--precision int8`` (``DEFAULT_OPTIONS``: every GEMM int8,
  weights one scale per output column, one activation scale per row in the backbone's attention output and FFN
  GEMMs (export/int8/rowwise.py), QKV smoothed)
- ``fusion N=8 int8 per-tensor, FFN output fp32 (ORT)``: the default before issue 28's per-row activations (one
  activation scale per tensor, the FFN output GEMMs in fp32, QKV and FFN-in smoothed at alpha 0.5)
- ``fusion N=8 int8 every GEMM per-tensor (ORT)``: every GEMM int8 with ONNX Runtime's per-tensor activation scales,
  unsmoothed (ONNX Runtime's quantizer alone)
- all but the first are measured, not shipped; their gate is switched off here: benchmarks/int8_smooth.py
  measures what they do to labels (INT8_VARIANTS names them)
- ``fusionserve eager N``: the same folded model in PyTorch eager
- ``AdapterHub eager N``: AdapterHub's own model (BertAdapterModel, RobertaAdapterModel) with Fuse active, PyTorch eager

Geometries: ``minilm`` (the real all-MiniLM-L6-v2 weights), ``bert-base`` and ``roberta-base`` (random weights of
those shapes: hidden 768, 12 layers; RoBERTa with its 50,265-token vocabulary and positions offset by the pad id).

``--ort-only`` times the ONNX Runtime variants alone (plain, fusion N, 4 tasks): on a busy shared machine the eager
variants make a round of a base-sized geometry at batch 16 take minutes, and a few rounds cannot average the noise.

The int8 graphs are the fp32 N=8 artifact's validated graph quantized and gated as ``export --precision int8`` does
(``models.int8_copy``, which makes one again when its options changed). ``--int8`` times only plain (ORT), fusion
N=8 (ORT), the three int8 graphs and AdapterHub eager N=8, and records them in their own section
(results/latency_int8_smooth.*), leaving the full table as it was.

Writes benchmarks/results/latency.json, benchmarks/results/latency.png and the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from benchmarks.models import BenchModel, bert_base_folder, build, int8_copy, minilm_folder, roberta_base_folder
from benchmarks.report import machine, plot_median_bars, record
from fusionserve.scoring.timing import time_round_robin

HERE = Path(__file__).parent
GEOMETRIES = ("minilm", "bert-base", "roberta-base")  # in the order the tables list them
BASE_SIZED = ("bert-base", "roberta-base")  # 4x MiniLM's work per token: fewer rounds
N_VALUES = (2, 8, 16)
THREADS = 2


def _artifact(model: BenchModel, out: Path) -> Path:
    from fusionserve.export.artifact import export_artifact

    if not (out / "manifest.json").is_file():
        export_artifact(model.spec, out, max_seq_len=128, force=True)
    return out


INT8_VARIANTS = {  # artifact key -> the variant's name in the tables (fusion N=8 ... (ORT))
    "n8-int8": "int8",
    "n8-int8-tensor": "int8 per-tensor, FFN output fp32",
    "n8-int8-all": "int8 every GEMM per-tensor",
}


def _int8_artifacts(model: BenchModel, fp32: Path, work: Path) -> dict[str, Path]:
    """The shipped int8 (``DEFAULT_OPTIONS``: every GEMM, per-row activations in the backbone's MatMuls), the default
    before it (per-tensor activations, the FFN output GEMMs in fp32, QKV and FFN-in smoothed at alpha 0.5) and every GEMM
    with per-tensor activations, unsmoothed (ONNX Runtime's quantizer alone). Their gate is off (thresholds 0 and 1):
    only timed here, benchmarks/int8_smooth.py measures what they do to labels. Calibration: the validation grid (the
    weights are random; timings do not depend on the scales)."""
    from dataclasses import replace

    from fusionserve.export.int8.quantize import DEFAULT_OPTIONS, Int8Gate, Int8Options

    off = Int8Gate(0.0, 1.0)
    options = {
        "n8-int8": DEFAULT_OPTIONS,
        "n8-int8-tensor": Int8Options(
            fp32_roles=("ffn_out",), gate=off, smooth_alpha=0.5, smooth_roles=("attention_qkv", "ffn_in"), activations="tensor"
        ),
        "n8-int8-all": replace(DEFAULT_OPTIONS, fp32_roles=(), gate=off, smooth_alpha=None, activations="tensor"),
    }
    return {key: int8_copy(fp32, work / f"{key}-art", model.spec, o) for key, o in options.items()}


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    from fusionserve.serving.model.runtime import make_session

    session = make_session(path / "model.onnx", threads=THREADS, device="cpu")
    feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
    return lambda: session.run(["logits"], feeds)


def _eager_ours(spec: Path, feeds: dict[str, np.ndarray], task: str) -> Callable[[], object]:
    from fusionserve.export.build import build_model
    from fusionserve.export.spec import load_spec

    model = build_model(load_spec(spec))
    t = {k: torch.from_numpy(v) for k, v in feeds.items() if k != "task_id"}

    def run() -> object:
        with torch.inference_mode():
            return model.classify(t["input_ids"], t["attention_mask"], t["token_type_ids"], task=task)

    return run


def _eager_adapterhub(ref: torch.nn.Module, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    t = {k: torch.from_numpy(v) for k, v in feeds.items() if k != "task_id"}

    def run() -> object:
        with torch.inference_mode():
            return ref(**t).logits

    return run


def _feeds(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, size=(batch, seq), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
        "task_id": np.array([0], dtype=np.int64),
    }


def summary_ms(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per variant: median, p10 and p90 milliseconds and the number of timed calls."""
    return {
        k: {
            "median_ms": statistics.median(v),
            "p10_ms": float(np.percentile(v, 10)),
            "p90_ms": float(np.percentile(v, 90)),
            "runs": len(v),
        }
        for k, v in times.items()
    }


def run_geometry(
    name: str,
    base: Path,
    work: Path,
    batches: list[int],
    seq: int,
    rounds_scale: float,
    ort_only: bool = False,
    only_int8: bool = False,
) -> dict:
    print(f"== {name}: building and exporting models in {work}", file=sys.stderr)
    plain = build(work / "plain", base, 0)
    fused = {n: build(work / f"n{n}", base, n) for n in ((8,) if only_int8 else N_VALUES)}
    arts = {"plain": _artifact(plain, work / "plain-art")}
    arts |= {f"n{n}": _artifact(m, work / f"n{n}-art") for n, m in fused.items()}
    if not only_int8:
        arts["n8-4tasks"] = _artifact(build(work / "n8-4tasks", base, 8, n_tasks=4), work / "n8-4tasks-art")
    arts |= _int8_artifacts(fused[8], arts["n8"], work)
    vocab = int(json.loads((base / "config.json").read_text())["vocab_size"])
    sizes_mb = {k: round(sum(f.stat().st_size for f in p.glob("model.onnx*")) / 2**20, 1) for k, p in arts.items()}

    result: dict = {"geometry": name, "seq": seq, "artifact_mb": sizes_mb, "machine": machine(), "batches": {}}
    for batch in batches:
        feeds = _feeds(batch, seq, vocab)
        feeds3 = dict(feeds, task_id=np.array([3], dtype=np.int64))
        variants: dict[str, Callable[[], object]] = {"plain (ORT)": _ort(arts["plain"], feeds)}
        if not (ort_only or only_int8):
            variants["plain (PyTorch eager)"] = _eager_ours(plain.spec, feeds, "task0")
        for n, m in fused.items():
            variants[f"fusion N={n} (ORT)"] = _ort(arts[f"n{n}"], feeds)
            if not (ort_only or only_int8):
                variants[f"fusionserve eager N={n}"] = _eager_ours(m.spec, feeds, "task0")
            if not ort_only:
                variants[f"AdapterHub eager N={n}"] = _eager_adapterhub(m.reference, feeds)
        if not only_int8:
            variants["fusion N=8, 4 tasks (ORT)"] = _ort(arts["n8-4tasks"], feeds3)
        for key, what in INT8_VARIANTS.items():
            variants[f"fusion N=8 {what} (ORT)"] = _ort(arts[key], feeds)
        # one forward of BERT-base at batch 16 takes seconds here: fewer rounds for bigger work
        work_units = batch * seq * (4 if name in BASE_SIZED else 1)
        rounds = max(5, int(rounds_scale * (40 if work_units <= 512 else 12 if work_units <= 4096 else 6)))
        print(f"-- {name}, batch {batch}, seq {seq}: {len(variants)} variants x {rounds} rounds", file=sys.stderr)
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        result["batches"][str(batch)] = summary_ms(time_round_robin(variants, rounds, progress=True))
        load = f"{load_before} before, {' '.join(f'{x:.2f}' for x in os.getloadavg())} after"
        result.setdefault("load_average", {})[str(batch)] = load
    return result


def ratios(res: dict) -> dict[str, dict[str, float]]:
    """Per batch: fusion N / plain (ORT), AdapterHub eager N / fusion N (ORT), 4-task / 1-task graph, fp32 / int8 (those
    whose variants were timed: ``--ort-only`` leaves out the eager ones, ``--int8`` all but N=8, older runs int8)."""
    out = {}
    for batch, row in res["batches"].items():
        pairs = {f"fusion N={n} / plain": (f"fusion N={n} (ORT)", "plain (ORT)") for n in N_VALUES}
        pairs |= {f"AdapterHub eager N={n} / fusion N={n}": (f"AdapterHub eager N={n}", f"fusion N={n} (ORT)") for n in N_VALUES}
        pairs["4-task graph / 1-task graph (N=8)"] = ("fusion N=8, 4 tasks (ORT)", "fusion N=8 (ORT)")
        pairs["plain PyTorch eager / plain ORT"] = ("plain (PyTorch eager)", "plain (ORT)")
        pairs |= {f"fusion N=8 fp32 / {w}": ("fusion N=8 (ORT)", f"fusion N=8 {w} (ORT)") for w in INT8_VARIANTS.values()}
        pairs |= {
            f"AdapterHub eager N=8 / fusion N=8 {w}": ("AdapterHub eager N=8", f"fusion N=8 {w} (ORT)")
            for w in INT8_VARIANTS.values()
        }
        out[batch] = {k: row[a]["median_ms"] / row[b]["median_ms"] for k, (a, b) in pairs.items() if a in row and b in row}
    return out


def _machine_line(m: dict[str, str]) -> str:
    return (
        f"{m['cpu']}, {m['cores']} cores, {THREADS} threads per run; {m['python']}, onnxruntime {m['onnxruntime']}, "
        f"torch {m['torch']}; {m['date']}" + (f"; ISA flags: {m['isa']}" if "isa" in m else "")
    )


def markdown(results: list[dict], commands: list[str]) -> str:
    """The tables; each geometry says the machine it was measured on (re-measuring one keeps the others' figures)."""
    lines = [
        "Command: "
        + ", then ".join(f"`{c}`" for c in commands)
        + (" (each later command re-measured the geometries it names and kept the others)" if len(commands) > 1 else ""),
        "",
        f"Median of round-robin rounds after 2 warm-up calls each, sequence length {results[0]['seq']}, CPU; every variant "
        "in fp32 but those named int8 (`--precision int8`).",
        "",
    ]
    for res in results:
        batches = list(res["batches"])
        lines += [f"### {res['geometry']}", "", f"Machine: {_machine_line(res['machine'])}.", ""]
        lines += ["| variant | " + " | ".join(f"batch {b} (ms)" for b in batches) + " |"]
        lines.append("|---|" + "---:|" * len(batches))
        for variant in res["batches"][batches[0]]:
            cells = [
                f"{res['batches'][b][variant]['median_ms']:.1f} ({res['batches'][b][variant]['runs']} runs)" for b in batches
            ]
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        rat = ratios(res)
        lines += ["", "| ratio | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---:|" * len(batches)]
        for key in rat[batches[0]]:
            lines.append(f"| {key} | " + " | ".join(f"{rat[b][key]:.2f}x" for b in batches) + " |")
        sizes = ", ".join(f"{k} {v} MB" for k, v in res["artifact_mb"].items())
        lines += ["", f"Artifact sizes (model.onnx): {sizes}."]
        if "load_average" in res:  # a machine shared with other jobs: the load around each batch's rounds
            loads = "; ".join(f"batch {b}: {v}" for b, v in res["load_average"].items())
            lines += ["", f"Load average (1, 5, 15 min) around the timing: {loads}."]
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(len(res["batches"]) for res in results)
    fig, axes = plt.subplots(len(results), width, figsize=(5.5 * width, 4.2 * len(results)), squeeze=False)
    for i, res in enumerate(results):
        for j in range(len(res["batches"]), width):
            axes[i][j].set_visible(False)
        for j, b in enumerate(res["batches"]):
            ax, row = axes[i][j], res["batches"][b]
            for label, key, style in (
                ("fusionserve ONNX", "fusion N={} (ORT)", "o-"),
                ("fusionserve eager", "fusionserve eager N={}", "s--"),
                ("AdapterHub eager", "AdapterHub eager N={}", "^-"),
            ):
                if key.format(N_VALUES[0]) in row:  # --ort-only times no eager variant
                    ax.plot(N_VALUES, [row[key.format(n)]["median_ms"] for n in N_VALUES], style, label=label)
            ax.axhline(row["plain (ORT)"]["median_ms"], color="gray", linestyle=":", label="plain backbone + head (ONNX)")
            ax.set_title(f"{res['geometry']}, batch {b}, seq {res['seq']}")
            ax.set_xlabel("adapters fused (N)")
            ax.set_ylabel("median latency (ms)")
            ax.set_xticks(N_VALUES)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_bars(results: list[dict], path: Path) -> None:
    """--int8: median ms of every timed variant, one panel per geometry and batch."""
    plot_median_bars(results, "batches", "{geometry}, batch {panel}, seq {seq}: median ms", path, width=6.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=GEOMETRIES)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds-scale", type=float, default=1.0, help="multiply the default number of rounds")
    p.add_argument(
        "--ort-only", action="store_true", help="time only the ONNX Runtime variants (more rounds in the time eager takes)"
    )
    p.add_argument("--int8", action="store_true", help="only the int8 comparison (N=8), in its own section")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    p.add_argument("--render-only", action="store_true", help="redo table and plot from the recorded results/latency.json")
    p.add_argument(
        "--keep-others", action="store_true", help="keep the recorded results of geometries not run now (re-measure one geometry)"
    )
    args = p.parse_args(argv)

    key, title, draw = (
        # its own section since issue 28 (smoothing, static QDQ); the AMD EPYC one before it stays as it was measured
        ("latency_int8_smooth", "Latency: int8 variants against fp32 (in-process, issue 28)", plot_bars)
        if args.int8
        else ("latency", "Latency (in-process)", plot)
    )
    if args.render_only:
        data = json.loads((args.out / f"{key}.json").read_text())
        commands = data.get("commands", [data["command"]])
        for r in data["results"]:
            r.setdefault("machine", data["machine"])
        record(args.out, key, title, data, lambda path: draw(data["results"], path), markdown(data["results"], commands), True)
        return 0
    torch.set_num_threads(THREADS)
    torch.set_num_interop_threads(1)
    command = "python -m benchmarks.latency " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for geo in args.geometries:
        random_bases = {"bert-base": bert_base_folder, "roberta-base": roberta_base_folder}
        base = minilm_folder() if geo == "minilm" else random_bases[geo](args.workdir)
        results.append(
            run_geometry(geo, base, args.workdir / geo, args.batches, args.seq, args.rounds_scale, args.ort_only, args.int8)
        )
    commands = [command.strip()]
    previous = args.out / f"{key}.json"
    if args.keep_others and previous.is_file():
        old = json.loads(previous.read_text())
        kept = [r for r in old["results"] if r["geometry"] not in args.geometries]
        for r in kept:  # recorded before results carried their own machine: the run's
            r.setdefault("machine", old["machine"])
        if kept:
            results = sorted([*kept, *results], key=lambda r: GEOMETRIES.index(r["geometry"]))
            commands = [*old.get("commands", [old["command"]]), *commands]
    data = {"command": " && ".join(commands), "commands": commands, "machine": machine(), "results": results}
    text = markdown(results, commands)
    record(args.out, key, title, data, lambda path: draw(results, path), text, not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
