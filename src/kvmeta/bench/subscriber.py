"""A KV event subscriber for benchmarks: a SUB socket on a thread that receives every batch.

A server publishing to nobody drops its batches at the socket; one with a subscriber pays for
sending them all. Measuring the cost of ``--events`` therefore needs a subscriber that keeps
up, and this one only receives (no decoding), so it takes little of the machine's CPU from the
server it measures.
"""

from __future__ import annotations

import threading
from types import ModuleType

from kvmeta.errors import MissingExtra

__all__ = ["Subscriber", "events_endpoint"]


def _zmq() -> ModuleType:
    try:
        import zmq
    except ImportError as exc:
        raise MissingExtra("`kvmeta bench pair --subscribe`", "events", exc, "subscribe") from None
    return zmq


def events_endpoint(args: list[str]) -> str | None:
    """The ``--events`` endpoint among ``kvmeta serve`` flags, as a local subscriber reaches
    it (a wildcard host becomes 127.0.0.1); None when the flags turn no events on."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith("--events="):
            value = arg.split("=", 1)[1]
        elif arg == "--events" and i + 1 < len(args):
            value = args[i + 1]
    if not value or value.lower() in ("off", "none", ""):
        return None
    for wildcard in ("://*:", "://0.0.0.0:"):
        value = value.replace(wildcard, "://127.0.0.1:")
    return value


class Subscriber:
    """Connected to ``endpoint`` until ``close``; ``batches`` and ``bytes`` count what came."""

    def __init__(self, endpoint: str) -> None:
        zmq = _zmq()
        self.endpoint = endpoint
        self.batches = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 0)  # never drop: the server must send every batch
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            self.batches += 1
            self.bytes += sum(len(f) for f in frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
