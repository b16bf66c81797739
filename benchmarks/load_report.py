"""The load benchmark's table, target lines and plot (from its JSON, so ``--render-only`` can redo them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.oip import markdown as oip_markdown


def _row(x: dict[str, Any]) -> str:
    return (
        f"| {x['clients']} | {x['requests']} | {x['errors']} | {x['lost']} | {x['throughput_rps']} | {x['p50_ms']} | "
        f"{x['p95_ms']} | {x['p99_ms']} | {x.get('mean_batch', '-')} |"
    )


def _by_clients(rows: list[dict[str, Any]], clients: int) -> dict[str, Any] | None:
    return next((x for x in rows if x["clients"] == clients), None)


def _comparison(r: dict[str, Any]) -> list[str]:
    lines = [
        "| ingress | p50, 1 client (ms) | req/s, 16 clients | mean batch, 16 | req/s, 64 clients | p99, 64 (ms) | replica port p50 (ms) | slowest 503 of the burst (ms) | start (s) | Ctrl-C (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in r["ingress"].items():
        one, sixteen, sixty4 = (_by_clients(v["rows"], c) or {} for c in (1, 16, 64))
        port = v.get("replica_port", {}).get("p50_ms", "-")
        lines.append(
            f"| {name} | {one.get('p50_ms', '-')} | {sixteen.get('throughput_rps', '-')} | {sixteen.get('mean_batch', '-')} | "
            f"{sixty4.get('throughput_rps', '-')} | {sixty4.get('p99_ms', '-')} | {port} | {v['burst']['max_503_ms']} | "
            f"{v['startup_s']} | {v['shutdown_s']} |"
        )
    echo = r["echo"]
    lines.append(
        f"| bare uvicorn + FastAPI echo (no model) | {echo[0]['p50_ms']} | {echo[1]['throughput_rps']} | - | - | - | - | - | - | - |"
    )
    return lines


def _targets(r: dict[str, Any], name: str) -> list[str]:
    v, ip = r["ingress"][name], r["in_process"]
    one, sixteen = _by_clients(v["rows"], 1), _by_clients(v["rows"], 16)
    best = max(x["texts_per_s"] for x in ip.values())
    batch1 = ip["1"]["median_batch_ms"]
    out = [f"Targets, `{name}`:"]
    if one:
        ok = one["p50_ms"] <= batch1 + 2
        ok_echo = one["p50_ms"] <= r["echo"][0]["p50_ms"] + 2
        out.append(
            f"- p50 at 1 client {one['p50_ms']} ms vs in-process batch 1 {batch1} ms + 2 = {batch1 + 2:.2f} ms: "
            f"{'met' if ok else 'NOT met'}; vs the echo app {r['echo'][0]['p50_ms']} + 2 ms: {'met' if ok_echo else 'NOT met'}."
        )
        served = r.get("in_process_served", {}).get("1")
        if served:
            ok_served = one["p50_ms"] <= served["median_batch_ms"] + 2
            out.append(
                f"  The model as the server runs it (no spinning threads), in-process batch 1: {served['median_batch_ms']} ms; "
                f"+ 2 ms: {'met' if ok_served else 'NOT met'} (the server's own cost: {one['p50_ms'] - served['median_batch_ms']:.2f} ms)."
            )
    if sixteen:
        share = sixteen["throughput_rps"] / best
        out.append(
            f"- 16 clients: {sixteen['throughput_rps']} req/s = {share:.0%} of the best in-process {best} texts/s "
            f"(target >= 80%: {'met' if share >= 0.8 else 'NOT met'}); mean batch {sixteen['mean_batch']} (target >= 8: "
            f"{'met' if sixteen['mean_batch'] >= 8 else 'NOT met'})."
        )
    c = v.get("server_cost")
    if c:
        out.append(
            f"  Alternating {c['rounds']} rounds on the idle server (in-process batch 1 as served, then 1 HTTP client): model "
            f"p50 {c['model_p50_ms']} ms, HTTP p50 {c['http_p50_ms']} ms; the server adds {c['added_ms_median']} ms "
            f"(median of per-round differences; target <= 2 ms: {'met' if c['added_ms_median'] <= 2 else 'NOT met'})."
        )
    errs = sum(x["errors"] + x["lost"] for x in v["rows"])
    b = v["burst"]
    out.append(f"- errors + lost over all rows: {errs} (target 0: {'met' if errs == 0 else 'NOT met'}).")
    out.append(
        f"- burst of {b['requests']} x 8 texts: {b['statuses']}, 503s in {b['p50_503_ms']} ms median, slowest {b['max_503_ms']} ms "
        f"(target < 100 ms: {_burst_verdict(b)}); "
        f"right after it: {v['after_burst']}."
    )
    if "echo_burst" in r:
        e = r["echo_burst"]
        out.append(
            f"  The same burst against the bare echo app (no model, every request answered): slowest answer {e['max_any_ms']} ms "
            "(what fresh connections cost the client and this machine)."
        )
    if "refusal_floor" in r:
        f = r["refusal_floor"]
        out.append(
            f"  The same burst against a server of `{f['ingress']}` that admits one waiting request (the model almost idle, "
            f"nearly every request refused): {f['statuses']}, 503s in {f['p50_503_ms']} ms median, slowest {f['max_503_ms']} ms "
            "(the refusal path's own cost for this burst on this machine)."
        )
    return out


def _burst_verdict(b: dict[str, Any]) -> str:
    if b["max_503_ms"] is None:
        return "no request refused: the burst did not reach the queue limit"
    return "met" if b["max_503_ms"] < 100 else "NOT met"


def _grpc(r: dict[str, Any]) -> list[str]:
    """gRPC beside HTTP: 1 client each, runs alternating against the same server (target: gRPC p50 <= HTTP p50)."""
    lines = [
        "gRPC vs HTTP, 1 client, the same server, runs alternating (target: gRPC p50 <= HTTP p50):",
        "",
        "| ingress | rounds x s | HTTP p50 (ms, median of rounds) | gRPC p50 (ms) | gRPC / HTTP (median of per-round ratios) | errors HTTP / gRPC | target |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for name, v in r["ingress"].items():
        g = v.get("grpc_vs_http")
        if not g:
            continue
        ok = g["ratio_p50_median"] <= 1.0
        lines.append(
            f"| {name} | {g['rounds']} x {g['seconds_per_run']:g} | {g['http']['p50_ms_median_of_rounds']} | "
            f"{g['grpc']['p50_ms_median_of_rounds']} | {g['ratio_p50_median']} | {g['http']['errors']} / {g['grpc']['errors']} | "
            f"{'met' if ok else 'NOT met'} |"
        )
    return lines


def _soak(s: dict[str, Any]) -> list[str]:
    start, end = sum(s["rss_start_mb"].values()), sum(s["rss_end_mb"].values())
    rps = [m["throughput_rps"] for m in s["minutes"]]
    errs = sum(m["errors"] + m["lost"] for m in s["minutes"])
    lines = [
        f"Soak: {s['seconds']:.0f} s at 16 clients on `{s['ingress']}`: {min(rps)}-{max(rps)} req/s per minute, errors + lost {errs}; "
        f"memory of every server process {start:.0f} MB at the start, {end:.0f} MB at the end ({(end - start) / start:+.1%}; target < +10%).",
        *(
            [f"Run apart, with `{s['command']}` (the machine busy with other work meanwhile: its rates are not comparable)."]
            if "command" in s
            else []
        ),
        "",
        "| process | start (MB) | end (MB) |",
        "|---|---:|---:|",
    ]
    # by pid: Ray retitles a process with the task it runs (ServeController -> ServeController.listen_for_change)
    end_by_pid = {name.rsplit("[", 1)[-1]: mb for name, mb in s["rss_end_mb"].items()}
    for name, mb in sorted(s["rss_start_mb"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {mb} | {end_by_pid.get(name.rsplit('[', 1)[-1], 'gone')} |")
    return lines


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"Command: `{r['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (server, clients and Ray share them); {m['python']}, onnxruntime {m['onnxruntime']}; "
        f"{m['date']}, load average {m.get('load_average', '-')} at the start. Task `{r['task']}` of `{r['artifact']}` on "
        f"{r['device']}, {r['replicas']} replica(s), one real sentence per "
        f"request, {r['seconds']:.0f} s per row, keep-alive closed-loop clients.",
        "",
        *_comparison(r),
        "",
        "| in-process batch | median batch (ms) | texts/s |",
        "|---:|---:|---:|",
        *[f"| {b} | {v['median_batch_ms']} | {v['texts_per_s']} |" for b, v in r["in_process"].items()],
        *[
            f"| {b}, no spinning (as served) | {v['median_batch_ms']} | {v['texts_per_s']} |"
            for b, v in r.get("in_process_served", {}).items()
        ],
    ]
    for name, v in r["ingress"].items():
        lines += [
            "",
            f"`{name}`:",
            "",
            "| clients | requests | errors | lost | req/s | p50 (ms) | p95 (ms) | p99 (ms) | mean batch |",
        ]
        lines += ["|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *[_row(x) for x in v["rows"]]]
        if "oip" in v:
            lines += ["", *oip_markdown(v["oip"])]
    lines += ["", *_targets(r, next(iter(r["ingress"])))]
    if any("grpc_vs_http" in v for v in r["ingress"].values()):
        lines += ["", *_grpc(r)]
    if "soak" in r:
        lines += ["", *_soak(r["soak"])]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, v in r["ingress"].items():
        xs = [x["clients"] for x in v["rows"]]
        a.plot(xs, [x["p50_ms"] for x in v["rows"]], "o-", label=f"{name} p50")
        b.plot(xs, [x["throughput_rps"] for x in v["rows"]], "o-", label=name)
    a.axhline(r["echo"][0]["p50_ms"], color="gray", linestyle=":", label="echo app p50, 1 client")
    a.axhline(r["in_process"]["1"]["median_batch_ms"], color="black", linestyle="--", label="model in-process, batch 1")
    a.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="latency (ms)", title="HTTP latency (p50)")
    best = max(v["texts_per_s"] for v in r["in_process"].values())
    b.axhline(best, linestyle="--", color="black", label="best in-process texts/s")
    b.axhline(0.8 * best, linestyle=":", color="gray", label="80% of it")
    b.set(xscale="log", xlabel="concurrent clients", ylabel="requests (texts) per second", title="Throughput")
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
