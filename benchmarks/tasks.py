"""Live tasks (``export --live`` + ``fusionserve tasks``) against today's way (a full export and a restart), in one run.

    python -m benchmarks.tasks [--targets 64] [--work DIR] [--export-points 0,1,16] [--clients 16] [--no-results]

On the default model (all-MiniLM-L6-v2, 7 adapters, 11 tasks) with new fusion targets made and saved by AdapterHub
(``task_targets.py``):

- export: the default model exported live, and full exports of it plus k targets (``--export-points``), quick grid;
- ``tasks add``: the first target by the CLI (a fresh process: imports included) to a checked, published revision;
  then every other target in-process (the time each add reports), and the last one by the CLI again, with
  ``--targets`` targets already there;
- memory: a runner (the replica's model object) in a fresh process moving through revisions 0..20, RSS after each,
  against the first plus the task files' bytes;
- scale: a batch of 16 rows of 16 different targets against the same batch with a one-task table, same graph;
- server (``fusionserve serve``, one replica, haproxy): ``--clients`` closed-loop clients on the model's own tasks
  before and during an add, a replace and a remove (each by the CLI); p99 before and during, failures, lost
  requests; seconds from each revision written (its pointer's mtime) to the first answer of the new task.

Writes benchmarks/results/tasks.json, tasks.png and its section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.httpload import Connection
from benchmarks.report import machine, write_section

HERE = Path(__file__).parent
SEQ = 64


def _cli(*argv: object) -> tuple[float, str]:
    """Run ``fusionserve`` in a fresh process; (wall seconds, stdout). Raises on failure."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fusionserve.cli.main", *map(str, argv)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fusionserve {' '.join(map(str, argv))}: {done.stderr[-2000:]}")
    return time.perf_counter() - t0, done.stdout.strip()


def _exports(spec: Path, work: Path, points: list[int]) -> dict[str, float]:
    from fusionserve.cli.default import DEFAULT_MODEL
    from fusionserve.export.artifact import export_artifact
    from fusionserve.export.spec import load_spec

    base = list(load_spec(DEFAULT_MODEL / "model.yaml").tasks)
    out = {}
    for k in points:
        t0 = time.perf_counter()
        tasks = [*base, *(f"target{i}" for i in range(k))]
        export_artifact(spec, work / f"full-{k}", progress=False, parity_grid="quick", tasks=tasks)
        out[str(len(tasks))] = round(time.perf_counter() - t0, 1)
        shutil.rmtree(work / f"full-{k}")
        print(f"full export, {len(tasks)} tasks: {out[str(len(tasks))]} s", flush=True)
    return out


def _bulk(art: Path, targets: Path, ks: range) -> float:
    """Setup, not a measure: targets ``ks`` folded in one model and published as one revision (what that many adds
    would publish, without each add's checks), to reach many targets in minutes on a busy box. Returns seconds."""
    from dataclasses import replace

    from fusionserve.export.build import build_model
    from fusionserve.export.live.tables import graph_tables, live_heads, source_of, task_record, write_task_file
    from fusionserve.export.spec import TaskSpec, load_spec
    from fusionserve.serving.model import revisions
    from fusionserve.serving.model.artifact import load_artifact
    from fusionserve.serving.model.runtime import make_session
    from fusionserve.serving.model.tables import table_specs

    t0 = time.perf_counter()
    a = load_artifact(art)
    spec = load_spec(Path(a.manifest["sources"]["spec"]["path"]))
    tasks = {
        f"target{k}": TaskSpec(f"target{k}", targets / "heads" / f"target{k}", targets / "fusions" / f"target{k}") for k in ks
    }
    model = build_model(replace(spec, tasks=tasks), stacks=(a.adapters, a.manifest["adapters_per_layer"]))
    specs = table_specs(make_session(a.model_path, device="cpu"))
    doc = revisions.read(art, a.revision or 0)
    entries = dict(doc["tasks"])
    for (name, _), slices in zip(
        model.task_index.items(), graph_tables(model, specs, live_heads(a.manifest["live"])), strict=True
    ):
        file, digest = write_task_file(art, name, slices)
        entries[name] = task_record(model, name, len(entries), file, digest, source_of(replace(spec, tasks=tasks), name))
    number = max(revisions.numbers(art)) + 1
    revisions.write(
        art,
        {"revision": number, "parent": a.revision, "change": {"op": "bulk (benchmark setup)"}, "tasks": entries, "checks": {}},
    )
    revisions.publish(art, number)
    return time.perf_counter() - t0


def _adds(art: Path, targets: Path, n: int, in_process: int) -> dict[str, Any]:
    from fusionserve.export.live.tasks import add_task
    from fusionserve.export.spec import TaskSpec

    def task(k: int) -> TaskSpec:
        return TaskSpec(f"target{k}", targets / "heads" / f"target{k}", targets / "fusions" / f"target{k}")

    first_s, first_out = _cli("tasks", "add", art, "target0", "--fusion", task(0).fusion, "--head", task(0).head)
    print(f"CLI add at T=11: {first_s:.1f} s: {first_out}", flush=True)
    inproc = []
    for k in range(1, 1 + in_process):
        doc = add_task(art, task(k))
        inproc.append((len(doc["tasks"]) - 1, doc["change"]["seconds"]))
        print(f"add target{k} (T={inproc[-1][0]} before): {inproc[-1][1]} s", flush=True)
    bulk_s = _bulk(art, targets, range(1 + in_process, n - 1))
    print(f"bulk setup to T={10 + n - 1}: {bulk_s:.0f} s", flush=True)
    last_s, last_out = _cli("tasks", "add", art, f"target{n - 1}", "--fusion", task(n - 1).fusion, "--head", task(n - 1).head)
    print(f"CLI add at T={10 + n}: {last_s:.1f} s: {last_out}", flush=True)
    last = max(int(p.stem) for p in (art / "revisions").glob("[0-9]*.json"))
    reported = [json.loads((art / "revisions" / f"{r:06d}.json").read_text())["change"]["seconds"] for r in (1, last)]
    return {
        "cli_first_s": round(first_s, 2), "cli_first_reported_s": reported[0], "cli_last_s": round(last_s, 2),
        "cli_last_reported_s": reported[1], "tasks_before_last": 10 + n - 1, "in_process_s": inproc,
        "bulk_setup_s": round(bulk_s, 1),
    }  # fmt: skip


_REPLAY = """
import resource, sys, numpy as np
from fusionserve.serving.model.artifact import load_artifact
from fusionserve.serving.model.runtime import OnnxRunner, Served
from fusionserve.serving.model.predictions import TextInput
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
art, upto = sys.argv[1], int(sys.argv[2])
runner = OnnxRunner(load_artifact(art, revision=0), threads=1)
out = []
for r in [*range(upto + 1), upto, upto]:  # every revision in order, then the last again: no copy kept per revision
    a = load_artifact(art, verify=False, revision=r)
    runner.served = Served(a, runner._tables.load(a))
    for t in list(a.tasks)[-2:]:
        runner.logits(t, [TextInput("the food was great and the service was fine")] * 4)
    out.append(rss())
print(out)
"""


def _memory(art: Path) -> dict[str, Any]:
    upto = max(int(p.stem) for p in (art / "revisions").glob("[0-9]*.json"))
    done = subprocess.run([sys.executable, "-c", _REPLAY, str(art), str(upto)], capture_output=True, text=True, check=True)
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    docs = [json.loads((art / "revisions" / f"{r:06d}.json").read_text()) for r in (0, upto)]
    added = set(docs[1]["tasks"]) - set(docs[0]["tasks"])
    weights_mb = sum((art / docs[1]["tasks"][t]["file"]).stat().st_size for t in added) / 2**20
    limit = (rss[0] + weights_mb) * 1.10
    return {"rss_mb": [round(x, 1) for x in rss], "revisions": upto + 1, "added_tasks": len(added), "added_weights_mb": round(weights_mb, 1),
            "limit_mb": round(limit, 1), "met": rss[-1] <= limit}  # fmt: skip


def _scale(art: Path, rounds: int = 20) -> dict[str, Any]:
    from fusionserve.serving.model.runtime import OnnxRunner

    runner = OnnxRunner(art, threads=len(os.sched_getaffinity(0)))
    tables = runner.served.tables
    names = [t for t in runner.artifact.tasks if t.startswith("target")][:16]
    idx = np.array([runner.artifact.tasks[t].index for t in names])
    one = {k: np.ascontiguousarray(v[idx[:1]]) for k, v in tables.items()}
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(16, SEQ), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    runs = {"mixed": ({**feeds, "task_id": idx}, tables), "one": ({**feeds, "task_id": np.zeros(16, np.int64)}, one)}
    times: dict[str, list[float]] = {"mixed": [], "one": []}
    for _ in range(rounds):
        for name, (feed, tab) in runs.items():
            t0 = time.perf_counter()
            runner.session.run(None, {**feed, **tab})
            times[name].append((time.perf_counter() - t0) * 1000)
    mixed, single = float(np.median(times["mixed"])), float(np.median(times["one"]))
    return {"tasks_in_table": len(runner.artifact.tasks), "mixed_ms": round(mixed, 1), "one_task_ms": round(single, 1),
            "ratio": round(mixed / single, 3), "rounds": rounds, "seq": SEQ}  # fmt: skip


async def _load(port: int, tasks: list[str], clients: int, stop: threading.Event, log: list) -> None:
    texts = ["the food was great", "a dull and overlong film", "shares fell sharply on tuesday", "I loved it"]

    async def client(k: int) -> None:
        conn, i = Connection("127.0.0.1", port), k
        while not stop.is_set():
            body = json.dumps({"task": tasks[i % len(tasks)], "inputs": [texts[i % len(texts)]]}).encode()
            t0 = time.time()
            try:
                status, ms, _ = await conn.post("/v1/classify", body)
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
                status, ms = -1, 0.0
                await conn.close()
            log.append((t0, status, ms))
            i += clients
        await conn.close()

    await asyncio.gather(*(client(k) for k in range(clients)))


def _first_answer(port: int, task: str, since: float, timeout_s: float = 60) -> float:
    import http.client

    while time.time() - since < timeout_s:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request(
            "POST", "/v1/classify", json.dumps({"task": task, "inputs": ["hello"]}), {"content-type": "application/json"}
        )
        if conn.getresponse().status == 200:
            return time.time() - since
        time.sleep(0.02)
    raise RuntimeError(f"task {task} not answered {timeout_s} s after its revision")


def _server(art: Path, targets: Path, clients: int, work: Path) -> dict[str, Any]:
    from benchmarks import servers
    from fusionserve.serving.model.artifact import load_artifact

    tasks = [t for t in load_artifact(art).tasks if not t.startswith("target")]
    srv = servers.start_fusionserve(art, 8150, "haproxy", work)
    log: list[tuple[float, int, float]] = []
    stop = threading.Event()
    loader = threading.Thread(target=lambda: asyncio.run(_load(srv.port, tasks, clients, stop, log)))
    try:
        loader.start()
        time.sleep(15)
        change_start = time.time()
        f, h = targets / "fusions", targets / "heads"
        pointer = art / "revisions" / "CURRENT"
        visible = {}
        _cli("tasks", "add", art, "live_new", "--fusion", f / "target0", "--head", h / "target0")
        visible["add"] = _first_answer(srv.port, "live_new", pointer.stat().st_mtime)
        _cli("tasks", "add", art, "live_new", "--fusion", f / "target1", "--head", h / "target1", "--replace")
        _cli("tasks", "remove", art, "live_new")
        time.sleep(3)
        change_end = time.time()
        time.sleep(5)
    finally:
        stop.set()
        loader.join(60)
        srv.stop()
    before = [ms for t, s, ms in log if t < change_start and s == 200 and t > change_start - 12]
    during = [ms for t, s, ms in log if change_start <= t <= change_end and s == 200]
    failed = sum(1 for _, s, _ in log if s not in (200, -1))  # answered with an error
    lost = sum(1 for _, s, _ in log if s == -1)  # sent, never answered (connection dropped)
    p99 = (lambda xs: round(float(np.percentile(xs, 99)), 1)) if before and during else (lambda xs: None)
    return {"clients": clients, "requests": len(log), "failed": failed, "lost": lost,
            "p99_before_ms": p99(before), "p99_during_ms": p99(during), "p50_before_ms": round(float(np.median(before)), 1),
            "p50_during_ms": round(float(np.median(during)), 1), "change_window_s": round(change_end - change_start, 1),
            "revision_to_answer_s": round(visible["add"], 2)}  # fmt: skip


def _plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    adds = data["adds"]["in_process_s"]
    ax.plot([t for t, _ in adds], [s for _, s in adds], ".", label="tasks add (in-process, to a checked revision)")
    ax.plot([11, data["adds"]["tasks_before_last"]], [data["adds"]["cli_first_s"], data["adds"]["cli_last_s"]], "s",
            label="tasks add by the CLI (fresh process)")  # fmt: skip
    xs = [int(k) for k in data["exports"]]
    ax.plot(xs, list(data["exports"].values()), "o-", label="full export (quick parity grid)")
    ax.set_xlabel("tasks in the artifact (T)")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Adding a target: full export vs fusionserve tasks add (default model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=int, default=64)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fusionserve-bench-tasks")
    p.add_argument("--export-points", default="0,1")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--in-process-adds", type=int, default=6, help="adds timed one by one before the bulk setup")
    p.add_argument("--no-results", action="store_true")
    args = p.parse_args()
    from benchmarks.task_targets import make_targets
    from fusionserve.cli.default import DEFAULT_MODEL
    from fusionserve.export.artifact import export_artifact

    args.work.mkdir(parents=True, exist_ok=True)
    spec = make_targets(args.work / "targets", args.targets + 1)
    art = args.work / "live"
    data: dict[str, Any] = {"machine": machine(), "load_before": os.getloadavg(), "live_export_s": None}
    if not (art / "revisions" / "CURRENT").is_file():  # an earlier run's untouched export is reused
        t0 = time.perf_counter()
        export_artifact(DEFAULT_MODEL / "model.yaml", art, progress=False, parity_grid="quick", live=True, force=True)
        data["live_export_s"] = round(time.perf_counter() - t0, 1)
    if not (args.work / "live-serve").exists():
        shutil.copytree(art, args.work / "live-serve")
    data["adds"] = _adds(art, args.work / "targets", args.targets + 1, args.in_process_adds)
    data["scale"] = _scale(art)
    data["memory"] = _memory(art)
    data["server"] = _server(args.work / "live-serve", args.work / "targets", args.clients, args.work)
    data["exports"] = _exports(spec, args.work, [int(k) for k in args.export_points.split(",")])
    data["load_after"] = os.getloadavg()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "tasks.json").write_text(json.dumps(data, indent=2))
    _plot(data, out / "tasks.png")
    text = _report(data)
    print(text)
    if not args.no_results:
        write_section(HERE / "RESULTS.md", "tasks", "Live tasks: `fusionserve tasks` against a full export", text)


def _report(d: dict[str, Any]) -> str:
    a, m, s, srv = d["adds"], d["memory"], d["scale"], d["server"]
    m_ = d["machine"]
    return "\n".join([
        "Command: `python -m benchmarks.tasks` (default model, AdapterHub-saved fusion targets; quick parity grid for "
        f"exports). Machine: {m_['cpu']}, {m_['cores']} cores, onnxruntime {m_['onnxruntime']}, torch {m_['torch']}, "
        f"{m_['date']}; load average before {d['load_before'][0]:.1f}, after {d['load_after'][0]:.1f}.",
        "",
        "| measure | figure | target |",
        "| --- | --- | --- |",
        f"| full export, T = {', '.join(d['exports'])} tasks | {', '.join(f'{v:.0f} s' for v in d['exports'].values())} | - |",
        f"| live export of the default model (T = 11) | {d['live_export_s'] or '-'} s | - |",
        f"| `tasks add` by the CLI at T = 11 (fresh process; the add itself) | {a['cli_first_s']:.1f} s ({a['cli_first_reported_s']:.1f} s) | <= 10 s |",
        f"| `tasks add` by the CLI at T = {a['tasks_before_last']} | {a['cli_last_s']:.1f} s ({a['cli_last_reported_s']:.1f} s) | <= 10 s |",
        f"| `tasks add` in-process at T = {', '.join(str(t) for t, _ in a['in_process_s'])} | {', '.join(f'{x:.1f}' for _, x in a['in_process_s'])} s | constant in T |",
        f"| revision written -> the server answers the new task | {srv['revision_to_answer_s']:.2f} s | <= 5 s |",
        f"| {srv['clients']} clients through add, replace, remove: failed / lost | {srv['failed']} / {srv['lost']} of {srv['requests']} | 0 / 0 |",
        f"| p99 before / during the changes ({srv['change_window_s']:.0f} s window) | {srv['p99_before_ms']} / {srv['p99_during_ms']} ms | during <= 2x before |",
        f"| RSS through {m['revisions']} revisions, {m['added_tasks']} tasks added (first {m['rss_mb'][0]:.0f} MB, + {m['added_weights_mb']:.0f} MB of task files) | {m['rss_mb'][-1]:.0f} MB (limit {m['limit_mb']:.0f}) | {'met' if m['met'] else 'NOT met'} |",
        f"| mixed batch of 16 over {s['tasks_in_table']} tasks vs one task, seq {s['seq']} | {s['mixed_ms']} / {s['one_task_ms']} ms = {s['ratio']}x | <= 1.1x |",
        "",
        "![tasks](results/tasks.png)",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
