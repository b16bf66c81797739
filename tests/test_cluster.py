"""Multi-node, really run: a Ray cluster of two nodes on this machine (``ray start --head`` and ``ray start
--address`` with their own CPUs, temp dirs and HAProxy ports). ``fusionserve serve --ship-artifact`` joins it, the
artifact reaches the worker through Ray's runtime env, and replicas run on both nodes (by the node id each answer
carries). Under light load the worker node is killed (SIGKILL to all of its processes): serving goes on with no
request lost (a client retries a request whose connection broke, as any client of a cluster must). Before that,
``score --ray-address`` on the same cluster writes exactly what a local run writes."""

import itertools
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from fusionserve.cli.main import main
from fusionserve.serving.process.ports import free_port
from tests import cluster_helpers as ch
from tests.adapterhub_models import SENTENCES
from tests.serving_helpers import Served, stop

pytestmark = pytest.mark.slow
CLIENTS = 3
PAUSE_S = 0.1  # light load: each client waits this long between requests (about 25 requests/s in all here)
# The GCS health-checks every raylet every second and declares a node dead after 5 failed checks in a row (Ray's
# defaults: every 3 s, 5 failures, ~20 s after a kill here); each check may still take up to Ray's 10 s before it fails,
# so a live raylet on a loaded machine is not declared dead sooner than before
NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}
# after the kill the load goes on across the GCS declaring the node dead and Serve's controller replacing the lost
# replica on the head (waited for at most REPLACED_WITHIN_S), then SETTLED_S more, and at least AFTER_KILL_S in all
REPLACED_WITHIN_S, SETTLED_S, AFTER_KILL_S = 90, 2, 10


@pytest.fixture(scope="module")
def cluster(artifact, tmp_path_factory):
    folder, art = tmp_path_factory.mktemp("cluster"), artifact
    head = ch.start_head(cpus=2, http_port=free_port(), grpc_port=free_port(), env=NODE_DEATH)
    nodes = [head]
    try:
        nodes.append(ch.start_worker(head, cpus=2))
        yield folder, art, head, nodes[1]
    finally:
        for node in reversed(nodes):
            ch.kill(node, remove=True)


def test_score_on_the_cluster_writes_what_a_local_run_writes(cluster):
    folder, art, head, _ = cluster
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "text": SENTENCES[i % len(SENTENCES)] + f" ({i})"}) + "\n" for i in range(40)))
    outputs = {how: folder / f"scored-{how}.jsonl" for how in ("local", "cluster")}
    argv = ["score", str(art), "--task", "rte", "--input", str(rows), "--all-scores", "--batch-size", "8", "--chunk-size", "16"]
    # the local run in this process (what it writes is the claim, not its process); the cluster's in a driver of its
    # own, with the cluster's token, as a user's `score --ray-address` runs
    assert main([*argv, "--output", str(outputs["local"])]) == 0
    cmd = [sys.executable, "-m", "fusionserve.cli.main", *argv, "--output", str(outputs["cluster"]),
           "--ray-address", head.address, "--ray-actors", "2"]  # fmt: skip
    done = subprocess.run(cmd, env=head.env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    local = outputs["local"].read_bytes()
    assert outputs["cluster"].read_bytes() == local and local.count(b"\n") == 40


@dataclass
class Tally:
    answered: list[tuple[float, float, str]] = field(default_factory=list)  # (sent, answered, node), per request
    retried: int = 0  # requests that needed more than one attempt
    lost: list[str] = field(default_factory=list)  # requests never answered 200, with the last failure


def _client(url: str, done: threading.Event, tally: Tally, lock: threading.Lock) -> None:
    body = json.dumps({"task": "rte", "inputs": [SENTENCES[0]]}).encode()
    while not done.is_set():
        sent, attempts, last = time.monotonic(), 0, ""
        while time.monotonic() - sent < 30:  # a request is lost only if no attempt succeeds within 30 s
            attempts += 1
            req = urllib.request.Request(url, body, {"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    node = resp.headers.get("x-fusionserve-node", "-")
                    with lock:
                        tally.answered.append((sent, time.monotonic(), node))
                        tally.retried += attempts > 1
                    break
            except (urllib.error.URLError, OSError) as exc:  # broken connection, 502/503 during the failover
                last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.1)
        else:
            with lock:
                tally.lost.append(last)
        time.sleep(PAUSE_S)


def _launch(art, head, log) -> Served:
    env = head.env | {"RAY_ADDRESS": head.address}
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(art), "--port", str(head.http_port), "--grpc-port",
           str(head.grpc_port), "--replicas", "2", "--threads", "1", "--ship-artifact"]  # fmt: skip
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while "fusionserve: serving" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"server not serving:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return Served(f"http://127.0.0.1:{head.http_port}", head.http_port, proc, log)


def test_replicas_on_both_nodes_and_serving_survives_the_worker_node(cluster, tmp_path):
    _, art, head, worker = cluster
    served = _launch(art, head, tmp_path / "serve.log")
    try:
        with ch.ReplicaWatch(head.address) as watch:
            watch.wait(2, 120)
            ids = dict(watch.nodes)
            assert sorted(ids.values()) == ["head", "worker"], ids
            # the worker's replica loaded Ray's copy of the artifact, unpacked under that node's own temp dir
            copies = [p for p in worker.temp_dir.glob("session_*/runtime_resources/working_dir_files/*/manifest.json")]
            assert copies, f"no copy of the artifact under {worker.temp_dir}"
            tally, lock = Tally(), threading.Lock()
            url = served.url + "/v1/classify"
            done = threading.Event()
            threads = [threading.Thread(target=_client, args=(url, done, tally, lock)) for _ in range(CLIENTS)]
            load_began = time.monotonic()
            for t in threads:
                t.start()
            before = _answered_by(tally, ids, {"head", "worker"}, within_s=12)
            killed_at = time.monotonic()
            killed = ch.kill(worker)
            print(f"\nthe kill came {killed_at - load_began:.1f} s after the load began, once {sorted(before)} had answered")
            replaced_s = watch.replaced(killed_at, 2, REPLACED_WITHIN_S)
            dead = "worker" not in watch.nodes.values()
            time.sleep(max(SETTLED_S, killed_at + AFTER_KILL_S - time.monotonic()))
            done.set()
            for t in threads:
                t.join(120)
        after = [(s, a, ids.get(n, n)) for s, a, n in tally.answered if s > killed_at + 5]
        window = _outage(tally, killed_at)
        replaced = f"{replaced_s:.1f} s" if replaced_s is not None else f"not within {REPLACED_WITHIN_S} s"
        print(
            f"\n2-node failover: {len(tally.answered)} answered, {len(tally.lost)} lost, {tally.retried} retried; "
            f"{killed} worker processes killed; the worker node {'declared dead' if dead else 'still alive to Ray'}, "
            f"its replica replaced {replaced} after the kill; the load ran {time.monotonic() - killed_at:.1f} s past it; "
            f"answers came from {sorted(before)} before, {sorted({n for *_, n in after})} after; longest gap between "
            f"answers after the kill {window['gap_s']:.2f} s, slowest request spanning it {window['slowest_s']:.2f} s"
        )
        assert before == {"head", "worker"}, before  # both nodes' replicas answered
        assert tally.lost == [], tally.lost[:3]
        answering = {n for *_, n in after}
        if answering - {"head", "worker"}:
            # seen once in 14 whole-suite runs (2026-11-27, -n 2, load ~11): after the kill a replica also answered from
            # a node id that was not alive when the test read the ids; what that node was is not known yet: say so
            print(f"\nnodes answering after the kill that were not alive at its start: {_nodes(head.address, answering)}")
        assert after and "head" in answering and "worker" not in answering  # the worker never answers again; the head serves
    finally:
        stop(served)
        assert served.proc.returncode == 0, served.log.read_text()[-2000:]


def _nodes(address: str, ids: set[str]) -> object:
    """Ray's view of the nodes ``ids`` (the id, its address, resources, alive, start time), for a failure's message."""
    code = (
        f"want = {sorted(ids)!r}\n"
        "out = [{k: n.get(k) for k in ('NodeID', 'NodeManagerAddress', 'Resources', 'Alive', 'NodeName')} "
        "for n in ray.nodes() if n['NodeID'] in want]"
    )
    return ch.ray_query(address, code)


def _answered_by(tally: Tally, ids: dict[str, str], nodes: set[str], within_s: float) -> set[str]:
    """The nodes that have answered, once all of ``nodes`` have or ``within_s`` has passed (the kill need not wait a
    fixed time for both replicas to have answered: at ~25 requests/s both have within a second or two)."""
    deadline = time.monotonic() + within_s
    while True:
        seen = {ids.get(node, node) for _, _, node in list(tally.answered)}
        if seen >= nodes or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def _outage(tally: Tally, killed_at: float) -> dict[str, float]:
    """The longest time no request was answered, from the kill on, and the slowest request sent around it."""
    ends = sorted([killed_at] + [a for _, a, _ in tally.answered if a >= killed_at])
    gap = max((b - a for a, b in itertools.pairwise(ends)), default=0.0)
    spanning = [a - s for s, a, _ in tally.answered if s <= killed_at + gap and a >= killed_at]
    return {"gap_s": gap, "slowest_s": max(spanning, default=0.0)}
