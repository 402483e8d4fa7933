"""Out of file descriptors with ``--events``: a flood of connections to the event socket must
not leave ZeroMQ's I/O thread spinning on a failed ``accept`` (it took a whole core), and once
the flood is gone subscribers are served again, with nothing missed that replay cannot give."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
import requests

from tests.events.events_support import Subscriber, endpoints, metric
from tests.support import ServerProcess, wait_until

pytestmark = pytest.mark.slow

WINDOW = 1.5  # seconds of server CPU measured while out of descriptors


@pytest.mark.soak
def test_a_connection_flood_on_the_events_port_does_not_spin_and_service_resumes() -> None:
    server = ServerProcess(
        "--in-memory", "--read-lease", "0", "--events", "tcp://127.0.0.1:0",
        "--events-replay", "tcp://127.0.0.1:0",
    ).start()  # fmt: skip
    flood: list[socket.socket] = []
    try:
        ends = endpoints(server)
        host, port = ends.pub.removeprefix("tcp://").rsplit(":", 1)
        session = requests.Session()  # a connection kept open: the server can answer on it
        assert session.get(server.url + "/health", timeout=30).ok
        used = len(os.listdir(f"/proc/{server.pid}/fd"))
        limit = used + 8
        subprocess.run(["prlimit", "--pid", str(server.pid), f"--nofile={limit}:"], check=True)
        refused = 0
        for _ in range(40):  # more than the descriptors left
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=5))
            except ConnectionRefusedError:  # the listener stopped: what it is for
                refused += 1
            time.sleep(0.01)
        wait_until(
            lambda: metric(server, "kvmeta_events_listen_pauses_total") >= 1,
            what="the listener to pause",
        )
        before = server.cpu_seconds()
        time.sleep(WINDOW)  # a measured window, not a wait
        spent = server.cpu_seconds() - before
        # A spinning listener costs a whole core (WINDOW s); paused, the server is idle.
        assert spent < WINDOW / 3, (
            f"the server used {spent:.2f} s of CPU in {WINDOW} s while out of descriptors"
        )
        assert refused, "the listener never stopped"
        assert session.get(server.url + "/health", timeout=30).ok
        assert metric(server, "kvmeta_events_listen_pauses_total") >= 1
        server.wait_for_log("events: not accepting connections on --events")
        assert "short of file descriptors" in server.log
        for conn in flood:
            conn.close()
        flood.clear()
        subprocess.run(["prlimit", "--pid", str(server.pid), "--nofile=4096:"], check=True)
        server.wait_for_log("events: listening on --events tcp://")
        sub = Subscriber(ends.pub).start()
        try:
            resp = session.post(server.url + "/0/initialize", json={"num_pages": 8}, timeout=30)
            assert resp.ok
            keys = [f"{i:064x}" for i in range(3)]
            reply = session.post(
                server.url + "/0/reserve_and_allocate_page_indices",
                json={"keys": [[k, None] for k in keys]},
                timeout=30,
            ).json()["indices"]
            pairs = [[k, p] for k, (_, p) in zip(keys, reply, strict=True)]
            body = {"written_keys_to_confirm": pairs}
            assert session.post(server.url + "/0/confirm_write", json=body, timeout=30).ok
            sub.wait_for(server)
            assert sub.messages, "no batch reached a subscriber after the flood"
        finally:
            sub.close()
        session.close()
    finally:
        for conn in flood:
            conn.close()
        server.stop()
