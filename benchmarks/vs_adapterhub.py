"""fusionserve's server against AdapterHub's eager model behind FastAPI, same model, same texts, same clients (issue
38: ">= 10x the throughput of AdapterHub's eager Fuse behind FastAPI, p50 <= 0.25x of it", MiniLM, N = 8, 16 clients).

    python -m benchmarks.vs_adapterhub [--precision bf16] [--autocast bf16] [--clients 16] [--seconds 15]
                                       [--rounds 3] [--tokens 128] [--workdir DIR] [--no-record]

The model: MiniLM's weights with N = 8 adapters and one fusion (``benchmarks.models.build``, as benchmarks.precisions
builds it), exported by fusionserve at ``--precision`` (default: what the built-in model would be served in on this
CPU, ``cli/default.choose_precision``) and served by ``fusionserve serve`` (HAProxy ingress, one replica, every core);
beside it ``benchmarks/hub_app.py``: the adapters library's model, one request at a time, under bf16 autocast with
``--autocast bf16`` (the default where the CPU has bf16 units, else fp32). Texts: rotten_tomatoes' test sentences
joined until each fills ``--tokens`` tokens (both servers truncate there). Each round runs ``--clients`` closed-loop
clients for ``--seconds`` against one server and then the other, the order alternating per round; the figures are the
medians over rounds of each round's ratios (fusionserve over AdapterHub: throughput, p50). Writes
results/vs_adapterhub.json and the section in RESULTS.md, with the CPU's flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks import servers
from benchmarks.httpload import closed_loop
from benchmarks.report import machine, record
from fusionserve.serving.process.ports import free_port

HERE = Path(__file__).parent
N_ADAPTERS = 8
TARGET_RPS, TARGET_P50 = 10.0, 0.25


def long_texts(tokenizer, tokens: int, count: int = 200) -> list[str]:
    """Test sentences of rotten_tomatoes joined until each text has at least ``tokens`` tokens."""
    from benchmarks.load import load_texts

    pool, out, i = load_texts("rotten_tomatoes"), [], 0
    while len(out) < count:
        parts: list[str] = []
        while len(tokenizer(" ".join(parts))["input_ids"]) < tokens:
            parts.append(pool[i % len(pool)])
            i += 1
        out.append(" ".join(parts))
    return out


def start_hub(root: Path, base: Path, autocast: str, tokens: int, logs: Path) -> servers.Server:
    env = dict(os.environ, HUB_ROOT=str(root), HUB_BASE=str(base), HUB_ADAPTERS=str(N_ADAPTERS), HUB_AUTOCAST=autocast)
    env["HUB_MAX_LENGTH"] = str(tokens)
    # the app builds the model before it answers: minutes on a loaded machine
    return servers.start_uvicorn("adapterhub", "benchmarks.hub_app:app", free_port(), logs, env, timeout_s=600)


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"Command: `{res['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (both servers, the clients and Ray share them); ISA flags: {m['isa']}; "
        f"{m['python']}, onnxruntime {m['onnxruntime']}, torch {m['torch']}; {m['date']}; load average "
        f"{res['load_before']} before, {res['load_after']} after. MiniLM, N = {N_ADAPTERS} adapters and one fusion; "
        f"fusionserve at {res['precision']}, AdapterHub eager {'under bf16 autocast' if res['autocast'] else 'fp32'}; "
        f"{res['clients']} closed-loop clients, one text of {res['tokens']} tokens per request, {res['seconds']:g} s "
        "per run.",
        "",
        "| round | fusionserve req/s | p50 (ms) | AdapterHub req/s | p50 (ms) | throughput ratio | p50 ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(res["rounds"]):
        f, h = r["fusionserve"], r["adapterhub"]
        lines.append(
            f"| {i + 1} | {f['throughput_rps']} | {f['p50_ms']} | {h['throughput_rps']} | {h['p50_ms']} | "
            f"{r['throughput_ratio']:.2f}x | {r['p50_ratio']:.3f} |"
        )
    t, p = res["throughput_ratio"], res["p50_ratio"]
    lines += [
        "",
        f"Median over rounds: fusionserve {t:.2f}x AdapterHub's throughput (target >= {TARGET_RPS:g}x: "
        f"{'met' if t >= TARGET_RPS else 'NOT met'}), p50 {p:.3f}x of it (target <= {TARGET_P50:g}: "
        f"{'met' if p <= TARGET_P50 else 'NOT met'}). Errors: fusionserve {res['errors']['fusionserve']}, AdapterHub "
        f"{res['errors']['adapterhub']}.",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("fusionserve", "adapterhub")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in zip(axes, ("throughput_rps", "p50_ms"), ("requests/s", "p50 (ms)"), strict=True):
        for i, name in enumerate(names):
            values = [r[name][key] for r in res["rounds"]]
            ax.bar([j + 0.4 * i for j in range(len(values))], values, width=0.4, label=name)
        ax.set_xticks([j + 0.2 for j in range(len(res["rounds"]))], [f"round {j + 1}" for j in range(len(res["rounds"]))])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"MiniLM N={N_ADAPTERS}, {res['clients']} clients, {res['tokens']} tokens: fusionserve {res['precision']} "
                 f"vs AdapterHub {'bf16 autocast' if res['autocast'] else 'fp32'}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", choices=["fp32", "int8", "bf16"], help="fusionserve's (default: the CPU's choice)")
    p.add_argument("--autocast", choices=["bf16", "none"], help="AdapterHub under bf16 autocast (default: where bf16 units)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench-vs-adapterhub")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from benchmarks.models import build, minilm_folder
    from fusionserve.cli.default import choose_precision
    from fusionserve.export.artifact import export_artifact
    from fusionserve.serving.model.cpu_flags import cpu_bf16_units

    precision = args.precision or choose_precision("cpu")[0]
    autocast = (args.autocast or ("bf16" if cpu_bf16_units() else "none")) == "bf16"
    base, root = minilm_folder(), args.workdir / "model"
    spec = build(root, base, N_ADAPTERS).spec
    art = args.workdir / f"{precision}-{args.tokens}-art"
    if not (art / "manifest.json").is_file():
        export_artifact(spec, art, precision, max_seq_len=args.tokens, force=True, parity_grid="quick")
    texts = long_texts(AutoTokenizer.from_pretrained(str(base)), args.tokens)
    body = servers.body_maker("task0", texts)
    command = "python -m benchmarks.vs_adapterhub " + " ".join(argv if argv is not None else sys.argv[1:])
    res: dict = {"command": command.strip(), "machine": machine(), "precision": precision, "autocast": autocast,
                 "clients": args.clients, "seconds": args.seconds, "tokens": args.tokens, "rounds": [],
                 "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="fusionserve-vs-adapterhub-"))
    ours = servers.start_fusionserve(art, free_port(), "haproxy", logs)
    try:
        hub = start_hub(root, base, "bf16" if autocast else "", args.tokens, logs)
        try:
            targets = {"fusionserve": ours.port, "adapterhub": hub.port}
            for port in targets.values():  # warm-up: first requests, allocations, OpenVINO's first runs
                closed_loop(port, "/v1/classify", body, args.clients, min(5.0, args.seconds))
            for r in range(args.rounds):
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                row = {name: closed_loop(targets[name], "/v1/classify", body, args.clients, args.seconds) for name in order}
                row["throughput_ratio"] = row["fusionserve"]["throughput_rps"] / max(row["adapterhub"]["throughput_rps"], 1e-9)
                row["p50_ratio"] = row["fusionserve"]["p50_ms"] / row["adapterhub"]["p50_ms"]
                print(f"vs_adapterhub: round {r + 1}: {json.dumps(row)}", file=sys.stderr, flush=True)
                res["rounds"].append(row)
        finally:
            hub.stop()
    finally:
        ours.stop()
    res["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    res["throughput_ratio"] = statistics.median(r["throughput_ratio"] for r in res["rounds"])
    res["p50_ratio"] = statistics.median(r["p50_ratio"] for r in res["rounds"])
    res["errors"] = {n: sum(r[n]["errors"] + r[n]["lost"] for r in res["rounds"]) for n in ("fusionserve", "adapterhub")}
    record(
        args.out,
        "vs_adapterhub",
        "fusionserve against AdapterHub behind FastAPI (issue 38)",
        res,
        lambda path: plot(res, path),
        markdown(res),
        not args.no_record,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
