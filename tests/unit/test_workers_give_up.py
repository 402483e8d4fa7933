"""The ``--workers`` supervisor gives up on workers that keep dying at start-up, and says so
with its exit code: a service manager (``Restart=on-failure``) restarts only a failed exit."""

from __future__ import annotations

import socket

from kvmeta.config import Settings
from kvmeta.server.workers import run_workers


def _returns_at_once(settings: Settings, sockets: list[socket.socket], announce: bool) -> None:
    """A worker that ends as soon as it starts, with exit code 0."""


def test_giving_up_on_workers_that_exit_cleanly_at_once_is_a_failure() -> None:
    settings = Settings(host="127.0.0.1", port=0, workers=2, backend="redis://127.0.0.1:1/0")
    assert run_workers(settings, _returns_at_once) != 0
