"""What else the CPU offers, timed against each other in one process (issue 13): ONNX Runtime's graph optimization
levels on the saved graph, intra-op threads and spinning, and ``--precision int8`` on a pruned artifact.

    python -m benchmarks.cpu_options [--rounds 6] [--batches 1 16] [--seq 128] [--workdir /tmp/w13] [--no-record]

Every variant is timed round-robin (``fusionserve.scoring.timing.time_round_robin``: each round runs every variant
once, in a shuffled order, after 2 warm-up calls each; here with an untimed 10 ms pause before each call) on random
token ids of exactly --seq tokens, as benchmarks/latency.py times them; the median over rounds is reported, and beside it the median over rounds of the
variant's time over its reference's in the same round (``paired_ratio``):

- MiniLM N=8 (benchmarks.latency's geometry: 8 seq_bn adapters and one fusion on all-MiniLM-L6-v2; its fp32 artifact
  from --bench, its int8 copy made by ``models.int8_copy`` under --workdir) in fp32 and int8, each with the session's
  graph optimization level disabled / basic / extended / all (the saved graph was already optimized at export:
  attention, LayerNorm and GELU fused), 2 intra-op threads, spinning; and at level all with 1 thread, and with 2
  threads not spinning (the server's setting). Reference: level all, 2 threads, spinning (``make_session``'s default).
- the default model's amazon_food fusion pruned to its top 2 adapters (``fusionserve prune --keep-top 2``, calibrated
  on amazon_food's dev split with the 11-task fp32 artifact), exported in fp32 and with ``--precision int8``, only
  amazon_food served. Reference: the fp32 pruned one. Its accuracy: amazon_food's whole test split, int8 against fp32
  (benchmarks.int8.compare: accuracy, label agreement, largest probability change).

Artifacts are reused from --workdir when they are there. The load average (``os.getloadavg``) is recorded before and
after the timing: the figures come from a machine shared with other jobs unless it says otherwise.
Writes benchmarks/results/cpu_options.json and .png, and its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from benchmarks.report import machine, record

HERE = Path(__file__).parent
THREADS = 2
LEVELS = ("disabled", "basic", "extended", "all")  # ORT_DISABLE_ALL, ORT_ENABLE_BASIC, _EXTENDED, _ALL
TARGET = "amazon_food"
KEEP = 2
# untimed sleep before each timed call: with many sessions in one process, the previous session's threads spinning for
# a next run took cores from the one timed (a probe of 9 sessions, MiniLM N=8 at batch 1: 2 threads without spinning
# 41 ms a call with no pause, 30 ms with 2 ms); each session's own threads still spin between the operators of its run
PAUSE_S = 0.01


def _level(name: str) -> Any:
    import onnxruntime as ort

    levels = ort.GraphOptimizationLevel
    return {
        "disabled": levels.ORT_DISABLE_ALL,
        "basic": levels.ORT_ENABLE_BASIC,
        "extended": levels.ORT_ENABLE_EXTENDED,
        "all": levels.ORT_ENABLE_ALL,
    }[name]


def _settings() -> dict[str, tuple[str, int, bool]]:
    """variant suffix -> (optimization level, intra-op threads, spinning)."""
    out = {f"level {lv}": (lv, THREADS, True) for lv in LEVELS}
    out["level all, 1 thread"] = ("all", 1, True)
    out["level all, no spinning"] = ("all", THREADS, False)
    return out


REFERENCE = "level all"


def _runner(path: Path, feeds: dict[str, np.ndarray], level: str, threads: int, spin: bool) -> Callable[[], object]:
    from fusionserve.serving.model.runtime import make_session

    session = make_session(path / "model.onnx", threads=threads, spin=spin, device="cpu", optimization=_level(level))
    feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
    return lambda: session.run(["logits"], feeds)


def bench_artifacts(bench: Path, work: Path) -> dict[str, Path]:
    """The MiniLM N=8 benchmark model's fp32 artifact (made by benchmarks.latency) and its shipped int8 copy."""
    from benchmarks.models import int8_copy

    fp32 = bench / "n8-art"
    if not (fp32 / "manifest.json").is_file():
        raise SystemExit(f"{fp32}: no artifact; make it with python -m benchmarks.latency --int8 --geometries minilm")
    return {"fp32": fp32, "int8": int8_copy(fp32, work / "n8-int8-art", bench / "n8" / "model.yaml")}


def pruned_artifacts(work: Path) -> dict[str, Path]:
    """The default model's amazon_food fusion pruned to its top KEEP adapters, in fp32 and int8 (only it served)."""
    from benchmarks.int8 import _split
    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE
    from fusionserve.export.artifact import export_artifact
    from fusionserve.export.prune import PruneRule, prune_artifact
    from fusionserve.scoring.calibrate import calibrate
    from fusionserve.scoring.inputs import read_labelled_jsonl
    from fusionserve.serving.model.activations import stats_document
    from fusionserve.serving.model.runtime import OnnxRunner

    spec, default = DEFAULT_MODEL / SPEC_FILE, work / "default"
    if not (default / "fp32" / "manifest.json").is_file():
        export_artifact(spec, default / "fp32", "fp32", 128, force=True, parity_grid="quick")
    stats = work / "prune" / "stats.json"
    if not stats.is_file():
        _split(TARGET, "dev", default, None)  # writes default/amazon_food.dev.jsonl
        dev = default / f"{TARGET}.dev.jsonl"
        found, _ = calibrate(OnnxRunner(default / "fp32", THREADS, device="cpu"), [TARGET], read_labelled_jsonl(dev, False))
        stats.parent.mkdir(parents=True, exist_ok=True)
        stats.write_text(json.dumps(stats_document(found, str(default / "fp32"), dev, 0), indent=2))
    out = {}
    for precision in ("fp32", "int8"):
        folder = out[precision] = work / "prune" / f"top{KEEP}-{precision}"
        if not (folder / "manifest.json").is_file():
            prune_artifact(spec, stats, PruneRule(keep_top=KEEP), folder, [TARGET], precision, 128, force=True)
    return out


def pruned_accuracy(pruned: dict[str, Path], work: Path) -> dict[str, Any]:
    """fp32 pruned against int8 pruned on amazon_food's whole test split (benchmarks.int8.compare)."""
    from benchmarks.int8 import _logits, _split, compare
    from fusionserve.serving.model.artifact import load_artifact
    from fusionserve.serving.model.runtime import OnnxRunner

    rows = _split(TARGET, "test", work / "default", None)
    runners = {p: OnnxRunner(f, THREADS, device="cpu") for p, f in pruned.items()}
    labels = runners["fp32"].task(TARGET).labels
    y = np.array([labels.index(r["label"]) for r in rows])
    result = compare(_logits(runners["fp32"], TARGET, rows), _logits(runners["int8"], TARGET, rows), y)
    manifest = load_artifact(pruned["int8"]).manifest
    gate = manifest["int8"]["gate"]
    result["kept"] = manifest["pruning"]["tasks"][TARGET]["kept"]
    result["gate"] = {k: gate[k] for k in ("label_agreement", "rows", "max_probability_change")}
    result["model_mb"] = {p: round((f / "model.onnx").stat().st_size / 2**20, 1) for p, f in pruned.items()}
    return result


def time_batch(bench: dict[str, Path], pruned: dict[str, Path], batch: int, seq: int, rounds: int) -> dict[str, Any]:
    """Per variant: median ms and runs; per variant, its paired ratio over its reference (>1: slower)."""
    from benchmarks.latency import _feeds
    from fusionserve.scoring.timing import paired_ratio, time_round_robin

    feeds = _feeds(batch, seq, 30522)  # MiniLM's vocabulary, both models
    variants, refs = {}, {}
    for precision, path in bench.items():
        for suffix, (level, threads, spin) in _settings().items():
            name = f"N=8 {precision}, {suffix}"
            variants[name] = _runner(path, feeds, level, threads, spin)
            refs[name] = f"N=8 {precision}, {REFERENCE}"
    for precision, path in pruned.items():
        name = f"{TARGET} top {KEEP} {precision}"
        variants[name] = _runner(path, feeds, "all", THREADS, True)
        refs[name] = f"{TARGET} top {KEEP} fp32"
    print(f"-- batch {batch}, seq {seq}: {len(variants)} variants x {rounds} rounds", file=sys.stderr)
    times = time_round_robin(variants, rounds, progress=True, pause_s=PAUSE_S)
    return {
        name: {
            "median_ms": statistics.median(ms),
            "runs": len(ms),
            "vs_reference": paired_ratio(times, name, refs[name]),
            "reference": refs[name],
            "ms": ms,
        }
        for name, ms in times.items()
    }


def markdown(result: dict[str, Any], command: str) -> str:
    m, acc = result["machine"], result["pruned_accuracy"]
    batches = list(result["batches"])
    load = ", ".join(f"{k} {' / '.join(f'{x:.2f}' for x in v)}" for k, v in result["load_average"].items())
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; {m['python']}, onnxruntime {m['onnxruntime']}; {m['date']}. "
        f"Load average (1 / 5 / 15 min): {load}: shared with other jobs, so single medians move; the ratios are "
        "medians over rounds of the variant's time over its reference's in the same round.",
        "",
        f"Sequence length {result['seq']}, random token ids, median of round-robin rounds after 2 warm-up calls each, an "
        f"untimed {1000 * PAUSE_S:.0f} ms pause before every call (the previous session's spinning threads stop). "
        f"Reference of each N=8 row: the same precision at level all, {THREADS} threads, spinning (what `make_session` "
        f"builds); of the pruned rows: the fp32 pruned one. 'faster in': the rounds in which the variant took less time "
        "than its reference.",
        "",
        "| variant | " + " | ".join(f"batch {b}: ms (runs) | vs reference | faster in" for b in batches) + " |",
        "|---|" + "---:|---:|---:|" * len(batches),
    ]
    for name in result["batches"][batches[0]]:
        cells = []
        for b in batches:
            v = result["batches"][b][name]
            ref = result["batches"][b][v["reference"]]["ms"]
            faster = "-" if v["reference"] == name else f"{sum(a < r for a, r in zip(v['ms'], ref, strict=True))}/{v['runs']}"
            cells += [f"{v['median_ms']:.1f} ({v['runs']})", f"{v['vs_reference']:.3f}x", faster]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Pruned pair (default model, {TARGET} fusion keeping {', '.join(acc['kept'])}; model.onnx "
        f"{acc['model_mb']['fp32']} MB fp32, {acc['model_mb']['int8']} MB int8), {TARGET}'s whole test split: fp32 "
        f"accuracy {acc['accuracy_ref']:.1f}%, int8 {acc['accuracy']:.1f}%, label agreement {acc['agreement']:.1f}%, "
        f"largest probability change {acc['max_probability_change']:.3f} ({acc['examples']} examples); the int8 gate "
        f"{100 * acc['gate']['label_agreement']:.1f}% / {acc['gate']['max_probability_change']:.3f} over "
        f"{acc['gate']['rows']} grid rows.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(result["batches"])
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 5.0), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        rows = result["batches"][b]
        ax.boxplot([v["ms"] for v in rows.values()], orientation="horizontal", showfliers=False)
        ax.set_yticks(range(1, len(rows) + 1), list(rows), fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per call (rounds)")
        ax.set_title(f"batch {b}, seq {result['seq']}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds at batch 16; batch 1 gets 4x (default 6)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bench", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "minilm")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "cpu_options")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    p.add_argument("--render-only", action="store_true", help="redo table and plot from the recorded results/cpu_options.json")
    args = p.parse_args(argv)
    title = "CPU options: optimization levels, threads, spinning, int8 on a pruned artifact (issue 13)"
    if args.render_only:
        data = json.loads((args.out / "cpu_options.json").read_text())
        text = markdown(data, data["command"])
        record(args.out, "cpu_options", title, data, lambda path: plot(data, path), text, not args.no_record)
        return 0
    command = ("python -m benchmarks.cpu_options " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    args.workdir.mkdir(parents=True, exist_ok=True)
    bench, pruned = bench_artifacts(args.bench, args.workdir), pruned_artifacts(args.workdir)
    accuracy = pruned_accuracy(pruned, args.workdir)
    load = {"before": list(os.getloadavg())}
    batches = {
        str(b): time_batch(bench, pruned, b, args.seq, args.rounds * (4 if b * args.seq <= 512 else 1)) for b in args.batches
    }
    load["after"] = list(os.getloadavg())
    result = {"seq": args.seq, "machine": machine(), "load_average": load, "batches": batches, "pruned_accuracy": accuracy}
    data = {"command": command, **result}
    text = markdown(result, command)
    record(args.out, "cpu_options", title, data, lambda path: plot(result, path), text, not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
