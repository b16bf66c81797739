"""A real `fusionserve serve` (Ray Serve, two replicas) on a live artifact while `fusionserve tasks` adds, replaces and
removes a task: clients on the other tasks never see a failure or a wrong answer, every replica moves to each new
revision by itself, the new task answers as AdapterHub's Fuse does, a refused change leaves the revision served, a
removed task is a 404 unknown_task.

Then its serving loop crashes (tests/fault_helpers.crash_leaves_nothing): the server exits 1 and leaves nothing (merged
here from tests/test_process_cleanup.py, whose test of it started a server of its own for nothing else)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fusionserve.cli.main import main
from fusionserve.serving.model.predictions import softmax
from tests.adapterhub_models import SENTENCES
from tests.fault_helpers import crash_leaves_nothing, crash_on_cue
from tests.live_helpers import FIRST, answers, live_once
from tests.serving_helpers import call, serving

pytestmark = pytest.mark.slow
TOL = 1e-4
CLIENTS = 4
PAUSE_S = 0.1  # between a client's requests: ~40 a second in all, several during every reload of a replica, and not
# clients that kept both cores busy through the whole test (taking them from the replicas that load the revisions)


def _probs(body: dict) -> np.ndarray:
    return np.array([list(p["scores"].values()) for p in body["predictions"]])


def _revisions_seen(url: str, polls: int = 12) -> dict[str, int]:
    """replica id -> the revision its /v1/tasks names, over ``polls`` calls (the ingress spreads them)."""
    seen = {}
    for _ in range(polls):
        with urllib.request.urlopen(f"{url}/v1/tasks", timeout=30) as resp:
            seen[resp.headers["x-fusionserve-replica"]] = int(json.loads(resp.read())["revision"])
    return seen


def _wait_for(url: str, revision: int, replicas: int = 2, timeout_s: float = 60) -> float:
    """Seconds until every replica serves ``revision``: one call at a time (the ingress spreads them), each replica's
    latest answer kept (a replica's revision only grows), until ``replicas`` of them name ``revision``. (Rounds of 12
    calls every 0.1 s sent ~100 requests a second to the replicas while they loaded each revision.)"""
    started, latest = time.monotonic(), {}
    while time.monotonic() - started < timeout_s:
        latest |= _revisions_seen(url, polls=1)
        if len(latest) == replicas and set(latest.values()) == {revision}:
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"replicas not on revision {revision} after {timeout_s} s: {_revisions_seen(url)}")


class _Clients:
    """CLIENTS threads classifying FIRST's tasks in a loop (PAUSE_S between requests), checking every answer against
    the local runner's."""

    def __init__(self, url: str, expected: dict[str, np.ndarray]) -> None:
        self.url, self.expected = url, expected
        self.stop, self.errors, self.answered = threading.Event(), [], 0
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(CLIENTS)]

    def _run(self, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            task, text = FIRST[(k + i) % len(FIRST)], (k * 7 + i) % len(SENTENCES)
            status, body = call(f"{self.url}/v1/classify", {"task": task, "inputs": [SENTENCES[text]]})
            if status != 200:
                self.errors.append(f"{task}: {status} {body}")
            elif not np.allclose(_probs(body)[0], self.expected[task][text], atol=TOL, rtol=0):
                self.errors.append(f"{task}: {_probs(body)[0]} != {self.expected[task][text]}")
            else:
                self.answered += 1
            i += 1
            self.stop.wait(PAUSE_S)

    def __enter__(self) -> _Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _classify(url: str, task: str) -> tuple[int, dict]:
    return call(f"{url}/v1/classify", {"task": task, "inputs": SENTENCES})


def test_add_replace_remove_on_a_running_server_under_load(tmp_path: Path, tmp_path_factory, marked):
    live = live_once(tmp_path_factory, tmp_path / "m")  # the live export made once per run: changed here in a copy
    art, root = live.copy(tmp_path / "artifact"), live.root
    expected = {t: softmax(answers(art, t).astype(np.float64)) for t in FIRST}
    mark, env = marked
    cue = crash_on_cue(tmp_path, env)
    args = ("--replicas", "2", "--threads", "1")
    with serving(art, tmp_path / "serve.log", *args, env=env, own_group=True) as srv:
        _wait_for(srv.url, 0)
        with _Clients(srv.url, expected) as clients:
            assert (
                main(
                    ["tasks", "add", str(art), "flat", "--fusion", str(root / "fusions/flat"), "--head", str(root / "heads/flat")]
                )
                == 0
            )
            _wait_for(srv.url, 1)
            status, body = _classify(srv.url, "flat")
            assert status == 200, body
            np.testing.assert_allclose(_probs(body), softmax(live.reference("flat").astype(np.float64)), atol=TOL, rtol=0)

            argv = [
                "tasks",
                "add",
                str(art),
                "flat",
                "--fusion",
                str(root / "fusions/custom"),
                "--head",
                str(root / "heads/custom"),
            ]
            assert main([*argv, "--replace"]) == 0
            _wait_for(srv.url, 2)
            status, body = _classify(srv.url, "flat")
            assert status == 200 and len(body["predictions"][0]["scores"]) == 4, body
            np.testing.assert_allclose(_probs(body), softmax(live.reference("custom").astype(np.float64)), atol=TOL, rtol=0)

            assert (
                main(["tasks", "add", str(art), "nli", "--fusion", str(root / "fusions/nli"), "--head", str(root / "heads/nli")])
                == 2
            )
            time.sleep(1.0)  # several polls: nothing was published, nothing moves
            assert set(_revisions_seen(srv.url).values()) == {2}

            assert main(["tasks", "remove", str(art), "flat"]) == 0
            _wait_for(srv.url, 3)
            status, body = _classify(srv.url, "flat")
            assert status == 404 and body["error"]["type"] == "unknown_task", body
            time.sleep(0.5)
        print(f"\n{clients.answered} answers checked, {len(clients.errors)} wrong or failed")
        assert clients.errors == [] and clients.answered > 20, (clients.errors[:5], clients.answered)
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        assert "fusionserve_artifact_revision" in metrics and 'fusionserve_revision_loads_total{result="loaded"}' in metrics
        crash_leaves_nothing(srv, cue, mark)
