"""``kvmeta events``: watch a server's event feed, like ``redis-cli monitor``.

A SUB socket on every topic prints each event as it arrives (``feed`` decodes and formats).
With ``--replay`` the catch-up procedure of docs/events.md is followed: subscribe first, then
ask the replay socket for the batches from ``--from``, show them, and drop the live batches
already shown; and whenever the live feed skips ahead (a batch lost on the way, or the
resync of a restarted server sent before the socket reconnected) ask for the missing ones
again. What cannot be shown (no ``--replay``, or gone from the replay buffer) is said on
stderr, and so is a new run (the server restarted) and the connection coming and going: an
operator watching the feed sees why it looks the way it does.

Exit codes: 0 after ``--count`` events or Ctrl-C, 1 when no batch arrived for ``--timeout``
seconds, 2 for a wrong option or a replay socket that does not answer (a one-line message
naming the option and the fix, through ``cli``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, TextIO

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvmeta.errors import ConfigError, ServerUnavailable
from kvmeta.events.feed import (
    Follower,
    MalformedEvent,
    decode_batch,
    event_fields,
    format_json,
    format_line,
    gap_notice,
    matches_pools,
    matches_tenants,
    run_notice,
    split_topic,
)
from kvmeta.events.replay import BUSY_PREFIX, END_MARKER

__all__ = [
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "REPLAY_WAIT",
    "TailOptions",
    "check_address",
    "fetch_replay",
    "tail",
]

EXIT_OK = 0
EXIT_TIMEOUT = 1
EXIT_USAGE = 2
# Seconds the replay socket has to send each frame of its answer. It answers from the server's
# event loop at once; only a server that is not there (or not a replay socket) takes longer.
REPLAY_WAIT = 10.0
# Seconds between asks while the replay socket answers busy, doubling up to the second.
_BUSY_PAUSE = (0.05, 1.0)
# A replay request for no batch at all: the answer is the end marker alone, so asking it
# checks at start that ``--replay`` names a replay socket without showing anything.
_NOTHING = (1 << 63) - 1
_TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]*]+):(?P<port>\d{1,5})")

Message = tuple[bytes, int, bytes]  # topic, sequence number, payload


@dataclass(frozen=True)
class TailOptions:
    """What ``kvmeta events`` was asked for (``cli`` builds it from the arguments)."""

    address: str
    replay: str | None = None
    start: int | None = None  # --from
    encoding: str | None = None  # --format; None: each event's shape says
    as_json: bool = False
    count: int | None = None
    timeout: float | None = None
    pools: tuple[str, ...] = ()
    tenants: tuple[str, ...] | None = None  # --tenant; None: every tenant


def check_address(text: str, option: str, server_flag: str, example: str) -> str:
    """``text`` when it is an address to connect to (``tcp://HOST:PORT``, ``ipc://PATH``),
    else a ``ConfigError`` naming ``option`` and what to give instead: ZeroMQ would take some
    malformed addresses (a host that never resolves) and retry them silently forever."""
    match = _TCP.fullmatch(text)
    if match is not None and 1 <= int(match.group("port")) <= 65535:
        return text
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    raise ConfigError(
        f"{option} {text!r} is not an address to connect to: give tcp://HOST:PORT (or "
        f"ipc://PATH), the server's {server_flag} address, e.g. {example}",
        option,
    )


def _check(options: TailOptions) -> None:
    check_address(options.address, "ADDRESS", "--events", "tcp://127.0.0.1:5557")
    if options.replay is not None:
        check_address(options.replay, "--replay", "--events-replay", "tcp://127.0.0.1:5558")
    elif options.start is not None:
        raise ConfigError(
            "--from needs --replay: the batches before now come from the server's replay "
            "socket (--replay tcp://HOST:PORT, its --events-replay address)",
            "--from",
        )
    if options.start is not None and options.start < 0:
        raise ConfigError("--from takes a sequence number >= 0, e.g. --from 0", "--from")
    if options.count is not None and options.count < 1:
        raise ConfigError("--count takes a number of events >= 1, e.g. --count 10", "--count")
    if options.timeout is not None and not options.timeout > 0:
        raise ConfigError(
            "--timeout takes a positive number of seconds, e.g. --timeout 5", "--timeout"
        )


def fetch_replay(
    ctx: zmq.Context[Any], endpoint: str, start: int, wait: float = REPLAY_WAIT
) -> list[Message]:
    """Every batch the replay socket at ``endpoint`` still holds from ``start`` on, up to its
    end marker (the request as a REQ socket sends it, from a DEALER; asked again while the
    socket answers busy, for ``wait`` seconds at most). ``ServerUnavailable``,
    naming ``--replay`` and the fix, when nothing listens there (refused at once), something
    else does (its answer is not the protocol's, or it drops the connection), or no answer
    comes within ``wait`` seconds (a host that never answers: no connection at all)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
    )
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected = False
        out: list[Message] = []
        deadline = time.monotonic() + wait
        busy_until = deadline
        pause = _BUSY_PAUSE[0]
        while True:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, int(left * 1000)))) if left > 0 else {}
            if not ready:
                raise ServerUnavailable(
                    f"--replay {endpoint}: no answer within {wait:g} s: give the address of "
                    "the server's replay socket (its --events-replay), or leave --replay out"
                )
            if monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    connected = True
                elif event == zmq.EVENT_DISCONNECTED:
                    # (ZeroMQ drops a peer of the wrong kind: a PUB socket, say.)
                    raise ServerUnavailable(
                        f"--replay {endpoint}: the connection was closed before an answer: "
                        "give the address of the server's replay socket (its --events-replay), "
                        "not its --events address"
                    )
                elif not connected:
                    raise ServerUnavailable(
                        f"--replay {endpoint}: nothing listens there (connection refused): "
                        "give the address of the server's replay socket (started with "
                        "--events-replay), or leave --replay out"
                    )
            if sock in ready:
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                    # (Another kind of server there: an HTTP port answers every connection.)
                    raise ServerUnavailable(
                        f"--replay {endpoint}: the answer is not the replay protocol's: give "
                        "the address of the server's replay socket (its --events-replay), not "
                        "its --events or HTTP address"
                    )
                deadline = time.monotonic() + wait
                _, topic, seq, payload = frames
                if seq == END_MARKER and payload.startswith(BUSY_PREFIX) and not out:
                    # Answering as many requests as it takes: ask again, for ``wait`` at most.
                    left = busy_until - time.monotonic()
                    if left <= 0:
                        raise ServerUnavailable(
                            f"--replay {endpoint}: the replay socket stayed busy for {wait:g} s "
                            "(it answers --events-replay-clients requests at once, and "
                            "requesters that do not read hold theirs until dropped): try again "
                            "later, or raise the server's --events-replay-clients"
                        )
                    time.sleep(min(pause, left))
                    pause = min(2 * pause, _BUSY_PAUSE[1])
                    sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
                    deadline = time.monotonic() + wait
                    continue
                if seq == END_MARKER:
                    return out
                out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


class _Tail:
    """The loop of one ``kvmeta events``: what it has shown, and its sockets."""

    def __init__(self, options: TailOptions, out: TextIO, err: TextIO) -> None:
        self.options = options
        self.out = out
        self.err = err
        self.follower = Follower(options.start)
        self.shown = 0
        self.done = False
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._connected = False
        self._refused_said = False

    def note(self, text: str) -> None:
        self.err.write(f"kvmeta events: {text}\n")
        self.err.flush()

    # ------------------------------------------------------------------ batches

    def take(self, message: Message, live: bool) -> None:
        """Show one batch unless it was shown already; a live batch that skips ahead first
        has the batches it skips fetched from the replay socket (docs/events.md, Replay)."""
        topic, seq, payload = message
        step = self.follower.check(topic, seq)
        if step.duplicate:
            return
        if self.options.replay is None:
            hint = "give --replay to fetch missed batches"
        else:
            hint = "no longer in the replay buffer: rebuild from GET /v1/dump"
        if step.missing and live and self.options.replay is not None:
            try:
                replayed = fetch_replay(self.ctx, self.options.replay, step.missing.start)
            except ServerUnavailable as exc:
                hint = f"the replay socket did not answer ({exc})"
            else:
                for old in replayed:
                    self.take(old, live=False)
                    if self.done:
                        return
                step = self.follower.check(topic, seq)
                if step.duplicate:
                    return
        if step.new_run or self.follower.topic is None:
            self.note(run_notice(topic, first=self.follower.topic is None))
        if step.missing:
            self.note(gap_notice(step.missing, split_topic(topic)[1], hint))
        self.follower.advance(topic, seq)
        self.show(topic, seq, payload)

    def show(self, topic: bytes, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(topic, seq, payload)
        except MalformedEvent as exc:
            self.note(str(exc))
            return
        run = split_topic(topic)[1]
        options = self.options
        lines = []
        for i, raw in enumerate(batch.events):
            try:
                fields = event_fields(raw, options.encoding)
            except MalformedEvent as exc:
                self.note(f"batch {seq} event {i}: {exc}")
                continue
            if not matches_pools(fields, options.pools):
                continue
            if not matches_tenants(fields, options.tenants):
                continue
            if options.as_json:
                lines.append(format_json(batch, fields))
            else:
                lines.append(format_line(batch.ts, seq, run, fields))
            self.shown += 1
            if options.count is not None and self.shown >= options.count:
                self.done = True
                break
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()

    # ------------------------------------------------------------------ sockets

    def watch_connection(self, monitor: zmq.Socket[Any]) -> None:
        """Say when the SUB socket connects, loses the server, or finds nobody listening
        (once, until it connects: ZeroMQ retries every 100 ms)."""
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            address = self.options.address
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                self._refused_said = False
                self.note(f"connected to {address}")
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._connected = False
                self.note(f"disconnected from {address}: waiting for the server to come back")
            elif event == zmq.EVENT_CONNECT_RETRIED and not self._refused_said:
                self._refused_said = True
                self.note(
                    f"nothing listens at {address} yet: waiting for it (the server's "
                    "--events address)"
                )

    def run(self) -> int:
        options = self.options
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        try:
            sub.connect(options.address)
            # Subscribed first, then the replay: what is published meanwhile waits in the
            # SUB socket and is dropped as a duplicate, or fills in after the replay.
            if options.replay is not None:
                start = _NOTHING if options.start is None else options.start
                for message in fetch_replay(self.ctx, options.replay, start):
                    self.take(message, live=False)
                    if self.done:
                        return EXIT_OK
            return self.follow(sub, monitor)
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            self.ctx.term()

    def follow(self, sub: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> int:
        timeout = self.options.timeout
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last = time.monotonic()
        while True:
            wait_ms: int | None = None
            if timeout is not None:
                left = last + timeout - time.monotonic()
                if left <= 0:
                    self.note(f"no batch for {timeout:g} s (--timeout)")
                    return EXIT_TIMEOUT
                wait_ms = max(1, int(left * 1000))
            ready = dict(poller.poll(wait_ms))
            if monitor in ready:
                self.watch_connection(monitor)
            if sub not in ready:
                continue
            while True:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                last = time.monotonic()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.note(f"a message of {len(frames)} frames ignored (not an event batch)")
                    continue
                self.take((frames[0], int.from_bytes(frames[1], "big"), frames[2]), live=True)
                if self.done:
                    return EXIT_OK


def tail(options: TailOptions, out: TextIO, err: TextIO) -> int:
    """Run ``kvmeta events`` until ``--count`` events, ``--timeout`` or Ctrl-C; the exit
    code. A wrong option raises ``ConfigError`` and a replay socket that does not answer
    ``ServerUnavailable``, before anything is shown."""
    _check(options)
    watcher = _Tail(options, out, err)
    try:
        return watcher.run()
    except KeyboardInterrupt:
        return EXIT_OK
