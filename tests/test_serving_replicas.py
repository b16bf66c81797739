"""How many replicas HAProxy routes to, read from its admin socket (serving/process/routing.py), also where a run
folder holds the socket of an earlier Ray node. That `serve` says it is serving only once HAProxy routes to both of two
replicas, and that load reaches both: tests/test_serving_faults_load.py (``test_two_replicas_both_serve``, on its
two-replica server before any fault)."""

import os
import socket
import threading

from fusionserve.serving.process.routing import routed_replicas
from fusionserve.serving.process.server import APP_NAME


def test_the_routed_replicas_are_read_from_the_live_haproxy_where_an_earlier_nodes_socket_is_left(tmp_path):
    """A start that drew a port another process took starts Ray again in the same run folder, under a new node id; the
    folder keeps the admin socket of the first node's HAProxy, which is gone. Read first when its node id sorted first
    (half the time), its refusal counted as "0 routed" for 120 s: the start waited that long and said "only 0 of 1
    replicas are routed" although the live HAProxy routed to it. Fails on the code before (0)."""
    stale, live = tmp_path / "0000-first-node" / "a.sock", tmp_path / "ffff-second-node" / "a.sock"
    for path in (stale, live):
        path.parent.mkdir()
    with socket.socket(socket.AF_UNIX) as gone:  # bound, then closed: the file stays, and refuses
        gone.bind(str(stale))
    os.utime(stale, (1, 1))  # the older of the two
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(live))
    server.listen()
    stat = f"# pxname,svname,status\nhttp-{APP_NAME},SERVE_REPLICA::{APP_NAME}#a,UP\nhttp-{APP_NAME},FALLBACK,UP\n"

    def answer() -> None:  # HAProxy's admin socket, for one command: the answer, then closed
        conn, _ = server.accept()
        with conn:
            conn.recv(100)
            conn.sendall(stat.encode())
        server.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    assert routed_replicas(tmp_path, APP_NAME) == 1
    thread.join(10)
    assert routed_replicas(tmp_path, APP_NAME) == 0  # none answers (HAProxy reloading): nothing routed this time
