"""The optimize step of an export (ONNX Runtime's transformer optimizer, export/onnx_export.py ``optimize``): proof that
two trees write the same graph for every kind of model the tests export, and the CPU of an export in each.

    python -m benchmarks.optimizer_passes models DIR
    PYTHONPATH=TREE TREE/.venv/bin/python benchmarks/optimizer_passes.py export DIR OUT
    python -m benchmarks.optimizer_passes compare OUT_A OUT_B
    python -m benchmarks.optimizer_passes cpu DIR --tree before=PYTHON:TREE --tree after=PYTHON:TREE [--rounds 3]

``models`` builds, with the real AdapterHub library, every model the export tests build (tests/adapterhub_models.py's
tiny BERT, tests/backbone_models.py's four backbones x two adapter architectures, each with tests/head_kinds.py's
heads of every kind, tests/live_helpers.py's live model) and lists the cases to export in DIR/cases.json: each at fp32
and fp16, the tiny one also at opsets 13 and 23, int8, pruned, with a subset of its tasks and live, and the built-in
default model (MiniLM). ``export`` exports every case with the fusionserve its interpreter imports (run it once with
each tree's own; both read the same built files) into OUT/<case>/. ``compare`` checks each case's model.onnx (the
same bytes, or else the same graph: nodes with their ops, inputs, outputs and attributes, initializers, inputs and
outputs, opsets) and the manifest's fused-operator counts; exit 1 on any difference.

``cpu`` exports the tiny model (fp32, 64 tokens, the full parity grid, as the tests' ``exported`` fixture) and the
default model (fp32, the quick grid, as its first use) in a fresh process of each tree in turn, ``--rounds`` times,
and prints per export the CPU seconds of ``export_artifact`` and of its optimize step (``time.process_time``: every
thread of the process), then the medians and the ratio of each tree to the first."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

Case = dict[str, Any]


def _heads(built: Any) -> Path:
    from tests.head_kinds import add_heads

    return add_heads(built.reference, built.spec.parent, built.tokenizer, classification="dyn").spec


def build_models(root: Path) -> list[Case]:
    """Every model under ``root``; the export cases over them."""
    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE
    from tests.adapterhub_models import build
    from tests.backbone_models import ADAPTER_CONFIGS, ARCHS, build_arch
    from tests.live_helpers import FIRST, build_live

    tiny = str(build(root / "tiny", safetensors=True).spec)
    live = str(build_live(root / "live").spec)
    cases: list[Case] = []
    for precision in ("fp32", "fp16"):
        cases.append({"name": f"tiny-{precision}", "spec": tiny, "precision": precision, "max_seq_len": 64})
        cases.append({"name": f"live-{precision}", "spec": live, "precision": precision, "max_seq_len": 40,
                      "live": True, "tasks": list(FIRST)})  # fmt: skip
    cases += [{"name": f"tiny-opset{o}", "spec": tiny, "opset": o, "max_seq_len": 64} for o in (13, 23)]
    cases.append({"name": "tiny-int8", "spec": tiny, "precision": "int8", "max_seq_len": 64})
    cases.append({"name": "tiny-pruned", "spec": tiny, "max_seq_len": 64, "dropped": {"rte": [["gamma"], [], ["beta"]]}})
    cases.append({"name": "tiny-tasks", "spec": tiny, "max_seq_len": 64, "tasks": ["nli", "head_only"]})
    for arch in ARCHS:
        for config in ADAPTER_CONFIGS:
            built = build_arch(root / f"{arch}-{config}", arch, config)
            heads = str(_heads(built))
            for precision in ("fp32", "fp16"):
                common = {"precision": precision, "max_seq_len": 40}
                cases.append({"name": f"{arch}-{config}-{precision}", "spec": str(built.spec), **common})
                cases.append({"name": f"{arch}-{config}-heads-{precision}", "spec": heads, **common})
            if (arch, config) == ("bert", "seq_bn"):
                cases.append({"name": "bert-seq_bn-heads-live", "spec": heads, "max_seq_len": 40, "live": True})
    default = str(DEFAULT_MODEL / SPEC_FILE)
    cases += [{"name": f"default-{p}", "spec": default, "precision": p, "parity_grid": "quick"} for p in ("fp32", "fp16")]
    return cases


def export_cases(root: Path, out: Path, only: list[str]) -> None:
    """Export each case not in ``out`` yet (those named in ``only``: again); the optimize step's graph and counts are
    kept as it wrote them (OUT/<case>/optimized.onnx, fused.json), before the parity check, which may refuse a graph
    both trees write (an fp16 export of a tagging head): that case's artifact is then missing."""
    import shutil

    import fusionserve.export.artifact as artifact
    from fusionserve.errors import FusionServeError

    optimize = artifact.optimize
    for case in json.loads((root / "cases.json").read_text()):
        folder = out / case["name"]
        if (only and case["name"] not in only) or (not only and (folder / "fused.json").is_file()):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

        def kept(raw: Path, graph: Path, *args: Any, _folder: Path = folder) -> Any:
            report = optimize(raw, graph, *args)
            shutil.copyfile(graph, _folder / "optimized.onnx")
            fused = {"found": report.counts, "expected": report.expected, "summary": report.describe()}
            (_folder / "fused.json").write_text(json.dumps(fused, indent=1, sort_keys=True))
            return report

        artifact.optimize = kept
        options = {k: v for k, v in case.items() if k not in ("name", "spec")}
        if "dropped" in options:
            options["dropped"] = {task: [frozenset(s) for s in sites] for task, sites in options["dropped"].items()}
        try:
            manifest = artifact.export_artifact(case["spec"], folder / "artifact", progress=False, **options)
            print(case["name"], manifest["fused_operators"]["summary"], flush=True)
        except FusionServeError as exc:
            print(case["name"], "refused:", str(exc).splitlines()[0], flush=True)
        finally:
            artifact.optimize = optimize


def _graph_difference(a: Path, b: Path) -> str | None:
    """None where the two ONNX files hold the same graph; else the first difference found."""
    import onnx

    ga, gb = onnx.load(str(a)).graph, onnx.load(str(b)).graph
    for field in ("node", "initializer", "input", "output", "sparse_initializer"):
        xa, xb = getattr(ga, field), getattr(gb, field)
        if len(xa) != len(xb):
            return f"{field}: {len(xa)} against {len(xb)}"
        for i, (ea, eb) in enumerate(zip(xa, xb, strict=True)):
            if ea.SerializeToString(deterministic=True) != eb.SerializeToString(deterministic=True):
                return f"{field} {i}: {getattr(ea, 'name', '')!r} differs"
    ma, mb = onnx.load(str(a), load_external_data=False), onnx.load(str(b), load_external_data=False)
    if [(o.domain, o.version) for o in ma.opset_import] != [(o.domain, o.version) for o in mb.opset_import]:
        return "opset imports differ"
    return None


def compare(a: Path, b: Path) -> int:
    names = sorted(p.name for p in a.iterdir() if p.is_dir())
    missing = sorted({p.name for p in b.iterdir() if p.is_dir()} ^ set(names))
    bad = len(missing)
    for name in missing:
        print(f"{name}: in one folder only")
    for name in (n for n in names if n not in missing):
        checks = []
        for graph in ("optimized.onnx", "artifact/model.onnx"):  # the optimize step's graph; the artifact's
            fa, fb = a / name / graph, b / name / graph
            if fa.is_file() != fb.is_file():
                checks.append(f"{graph} in one only")
            elif fa.is_file():
                same = fa.read_bytes() == fb.read_bytes()
                checks.append(f"{graph} " + ("same bytes" if same else _graph_difference(fa, fb) or "same graph"))
        counts_a, counts_b = (json.loads((d / name / "fused.json").read_text()) for d in (a, b))
        counts = {k: counts_a[k] for k in ("found", "expected")}
        ok = all(c.endswith(("same bytes", "same graph")) for c in checks) and counts == {k: counts_b[k] for k in counts}
        bad += not ok
        print(f"{name:34s} {'; '.join(checks)}; fused {'equal' if ok else 'DIFFER'}: {counts['found']}")
    print(f"{len(names) - bad} of {len(names)} cases identical" if not bad else f"{bad} case(s) differ or are missing")
    return 1 if bad else 0


# run in each tree's own interpreter: one export, its CPU and its optimize step's
_CHILD = """
import json, sys, time
import fusionserve.export.artifact as artifact
spent = []
optimize = artifact.optimize
def timed(*args, **kwargs):
    start = time.process_time()
    try:
        return optimize(*args, **kwargs)
    finally:
        spent.append(time.process_time() - start)
artifact.optimize = timed
spec, out, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
start = time.process_time()
artifact.export_artifact(spec, out, progress=False, **options)
print(json.dumps({"export_cpu_s": time.process_time() - start, "optimize_cpu_s": sum(spent)}))
"""


def cpu(root: Path, trees: list[tuple[str, str, str]], rounds: int) -> None:
    import tempfile

    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE

    models = {
        "tiny": (str(root / "tiny" / "model.yaml"), {"max_seq_len": 64}),
        "default": (str(DEFAULT_MODEL / SPEC_FILE), {"parity_grid": "quick"}),
    }
    seen: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(rounds):
        for model, (spec, options) in models.items():
            for name, python, tree in trees:
                env = {**os.environ, "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"}
                with tempfile.TemporaryDirectory() as tmp:
                    cmd = [python, "-c", _CHILD, spec, str(Path(tmp) / "a"), json.dumps(options)]
                    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                seen.setdefault((model, name), []).append(figures)
                print(json.dumps({"round": r, "model": model, "tree": name, **figures}), flush=True)
    first = trees[0][0]
    for model in models:
        base = {k: statistics.median(f[k] for f in seen[model, first]) for k in ("export_cpu_s", "optimize_cpu_s")}
        for name, _, _ in trees:
            med = {k: statistics.median(f[k] for f in seen[model, name]) for k in base}
            ratios = ", ".join(f"{k} {med[k]:.2f} ({med[k] / base[k]:.2f}x {first})" for k in med)
            print(f"median {model:8s} {name:8s} {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models").add_argument("dir", type=Path)
    exp = sub.add_parser("export")
    exp.add_argument("dir", type=Path)
    exp.add_argument("out", type=Path)
    exp.add_argument("--only", nargs="*", default=[])
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    cp = sub.add_parser("cpu")
    cp.add_argument("dir", type=Path)
    cp.add_argument("--tree", action="append", required=True, help="NAME=PYTHON:TREE")
    cp.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "models":
        args.dir.mkdir(parents=True, exist_ok=True)
        cases = build_models(args.dir.resolve())
        (args.dir / "cases.json").write_text(json.dumps(cases, indent=1))
        print(f"{len(cases)} cases in {args.dir / 'cases.json'}")
    elif args.command == "export":
        export_cases(args.dir, args.out, args.only)
    elif args.command == "compare":
        sys.exit(compare(args.a, args.b))
    else:
        trees = [(t.split("=", 1)[0], *t.split("=", 1)[1].split(":", 1)) for t in args.tree]
        cpu(args.dir, trees, args.rounds)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
