"""``store.redis.link``: many calls in flight on one connection, each getting its own reply,
against a real Redis-protocol server; a caller that gives up, a node that stops answering, a
node that closes the connection, and error replies named as redis-py names them."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from redis.exceptions import (
    ConnectionError,
    MovedError,
    NoScriptError,
    ResponseError,
    TimeoutError,
)

from kvmeta.store.redis.link import reply_error
from kvmeta.store.redis.nodes import Node
from kvmeta.store.redis.resp import pack
from kvmeta.store.redis.url import parse_target
from tests.redis_support import RedisServer

T = TypeVar("T")


def _run(make: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await make()

    return asyncio.run(main())


def _node(server: RedisServer, read_timeout: float = 2.0, password: str = "") -> Node:
    auth = f":{password}@" if password else ""
    target = parse_target(f"redis://{auth}127.0.0.1:{server.port}/0")
    return Node(target, "", 0, read_timeout=read_timeout)


def test_concurrent_calls_share_one_connection_and_get_their_own_replies(
    redis_server: RedisServer,
) -> None:
    async def go() -> tuple[list[Any], int]:
        node = _node(redis_server)
        try:
            await node.call("SET", "link:x", "0")
            values = [os.urandom(1 + i % 300) for i in range(500)]
            replies = await asyncio.gather(*(node.call("ECHO", v) for v in values))
            assert replies == values
            return replies, len(node.links)
        finally:
            await node.close()

    _, links = _run(go)
    assert links == 1


def test_links_speak_resp2_whatever_redis_py_defaults_to(redis_server: RedisServer) -> None:
    """kvmeta reads replies itself and its scripts answer in RESP2 shapes; redis-py 8 asks for
    RESP3 unless told otherwise (its HELLO 3 turns replies into maps and doubles)."""

    async def go() -> bytes:
        node = _node(redis_server)
        try:
            reply = await node.call("CLIENT", "INFO")
            assert isinstance(reply, bytes)
            return reply
        finally:
            await node.close()

    assert b" resp=2 " in _run(go)


def test_the_connection_set_up_never_asks_for_resp3() -> None:
    async def go() -> list[bytes]:
        async with _FakeRedis(lambda data: b"$1\r\na\r\n") as fake:
            node = _fake_node(fake.port)
            try:
                assert await node.call("ECHO", "a") == b"a"
            finally:
                await node.close()
            return fake.hellos

    assert b"3" not in _run(go)


def test_the_calls_of_one_loop_pass_go_out_in_one_write(redis_server: RedisServer) -> None:
    async def go() -> tuple[list[Any], int]:
        node = _node(redis_server)
        try:
            await node.call("PING")
            (link,) = node.links
            assert link.transport is not None
            writes = 0
            write = link.transport.write

            def counted(data: Any) -> None:
                nonlocal writes
                writes += 1
                write(data)

            link.transport.write = counted  # type: ignore[method-assign]
            replies = await asyncio.gather(*(node.call("ECHO", str(i)) for i in range(50)))
            return replies, writes
        finally:
            await node.close()

    replies, writes = _run(go)
    assert replies == [str(i).encode() for i in range(50)]
    assert writes == 1


def test_a_caller_that_gives_up_leaves_the_connection_in_step(redis_server: RedisServer) -> None:
    async def go() -> list[Any]:
        node = _node(redis_server)
        try:
            # A blocking command, abandoned by its caller; the calls after it still get their own
            # replies, on the same connection.
            slow = asyncio.ensure_future(node.call("BLPOP", "link:none", "0.2"))
            echoes = [asyncio.ensure_future(node.call("ECHO", str(i))) for i in range(5)]
            await asyncio.sleep(0.05)
            slow.cancel()
            replies = await asyncio.gather(*echoes)
            assert await node.call("ECHO", "after") == b"after"
            assert len(node.links) == 1
            return replies
        finally:
            await node.close()

    assert _run(go) == [str(i).encode() for i in range(5)]


def test_a_node_that_stops_answering_fails_the_waiting_calls_then_recovers() -> None:
    own = RedisServer().start()
    try:

        async def go() -> None:
            node = _node(own, read_timeout=0.5)
            try:
                assert await node.call("PING") in (b"PONG", True)
                os.kill(own.pid, signal.SIGSTOP)
                try:
                    results = await asyncio.gather(
                        *(node.call("ECHO", str(i)) for i in range(3)), return_exceptions=True
                    )
                finally:
                    os.kill(own.pid, signal.SIGCONT)
                assert all(isinstance(r, TimeoutError) for r in results), results
                assert "did not answer within 0.5s" in str(results[0])
                assert node.links == []  # the stalled connection is closed
                assert await node.call("ECHO", "back") == b"back"  # a new one
            finally:
                await node.close()

        _run(go)
    finally:
        own.close()


def test_a_connection_the_server_closes_fails_its_calls_and_the_next_call_reconnects(
    redis_server: RedisServer,
) -> None:
    async def go() -> None:
        node = _node(redis_server)
        try:
            await node.call("CLIENT", "SETNAME", "kvmeta-link-test")
            with redis_server.client() as admin:
                admin.client_kill_filter(_type="normal", skipme=True)
            with pytest.raises(ConnectionError):
                for _ in range(50):  # the close may take a moment to reach this process
                    await node.call("PING")
                    await asyncio.sleep(0.02)
            assert await node.call("ECHO", "again") == b"again"
        finally:
            await node.close()

    _run(go)


def test_a_password_in_the_url_is_used_by_every_link() -> None:
    own = RedisServer(password="s3cret").start()
    try:

        async def go() -> Any:
            node = _node(own, password="s3cret")
            try:
                return await node.call("ECHO", "authed")
            finally:
                await node.close()

        assert _run(go) == b"authed"
    finally:
        own.close()


def test_a_blocking_call_gets_a_connection_of_its_own(redis_server: RedisServer) -> None:
    """A call ending with WAIT holds its connection until the replicas answer (Redis serves
    nothing else on it meanwhile): the calls behind it go to another link."""

    async def go() -> int:
        node = _node(redis_server)
        try:
            await node.call("PING")
            # No replica: WAIT 1 300 answers 0 after 300 ms.
            wait = asyncio.ensure_future(
                node.request(pack(("SET", "link:w", "1")) + pack(("WAIT", 1, 300)), 2, True)
            )
            await asyncio.sleep(0.05)
            started = asyncio.get_running_loop().time()
            assert await node.call("ECHO", "free") == b"free"
            waited = asyncio.get_running_loop().time() - started
            assert waited < 0.25, waited  # not behind the WAIT
            assert await wait == [b"OK", 0]
            return len(node.links)
        finally:
            await node.close()

    assert _run(go) == 2


def test_blocking_calls_beyond_the_link_cap_queue_on_the_least_busy_link(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvmeta.store.redis.nodes.MAX_LINKS", 2)

    async def go() -> tuple[list[Any], int]:
        node = _node(redis_server)
        try:
            await node.call("PING")
            # No replica: each WAIT 1 100 answers 0 after 100 ms.
            calls = [
                node.request(pack(("SET", f"link:c{i}", i)) + pack(("WAIT", 1, 100)), 2, True)
                for i in range(5)
            ]
            replies = await asyncio.gather(*calls)
            return replies, len(node.links)
        finally:
            await node.close()

    replies, links = _run(go)
    assert replies == [[b"OK", 0]] * 5
    assert links == 2


def test_closing_a_node_fails_calls_in_flight_and_refuses_new_ones(
    redis_server: RedisServer,
) -> None:
    async def go() -> None:
        node = _node(redis_server)
        await node.call("PING")
        slow = asyncio.ensure_future(node.call("BLPOP", "link:none", "0.3"))
        await asyncio.sleep(0.05)
        await node.close()
        with pytest.raises(ConnectionError):
            await slow
        with pytest.raises(Exception, match="closed"):
            await node.call("PING")

    _run(go)


def test_error_replies_are_named_as_redis_py_names_them() -> None:
    moved = reply_error("MOVED 3999 127.0.0.1:6381")
    assert isinstance(moved, MovedError)
    assert (moved.slot_id, moved.host, moved.port) == (3999, "127.0.0.1", 6381)
    assert isinstance(reply_error("NOSCRIPT No matching script"), NoScriptError)
    generic = reply_error("ERR Function not found")
    assert type(generic) is ResponseError and str(generic) == "Function not found"
    unknown = reply_error("WEIRD thing happened")
    assert type(unknown) is ResponseError and str(unknown) == "WEIRD thing happened"
    assert isinstance(reply_error("ERR max number of clients reached"), ConnectionError)


def test_an_error_reply_among_replies_keeps_the_connection(redis_server: RedisServer) -> None:
    async def go() -> list[Any]:
        node = _node(redis_server)
        try:
            with pytest.raises(ResponseError):
                await node.call("NOSUCHCOMMAND")
            replies = await node.request(pack(("ECHO", "a")) + pack(("BAD",)), 2)
            assert replies[0] == b"a" and isinstance(replies[1], ResponseError)
            return [await node.call("ECHO", "b"), len(node.links)]
        finally:
            await node.close()

    assert _run(go) == [b"b", 1]


def _valkey_hello(proto: bytes) -> bytes:
    """Valkey's answer to ``HELLO <proto>``: a map in RESP3, a flat array in RESP2."""
    fields = [
        (b"+server", b"+valkey"),
        (b"+version", b"+9.0.0"),
        (b"+proto", b":" + proto),
        (b"+id", b":5"),
        (b"+mode", b"+standalone"),
        (b"+role", b"+master"),
        (b"+modules", b"*0"),
    ]
    head = b"%7" if proto == b"3" else b"*14"
    return b"\r\n".join([head, *(part for pair in fields for part in pair)]) + b"\r\n"


def _commands(data: bytes) -> list[list[bytes]]:
    """The commands (RESP arrays of bulk strings, as clients send them) in ``data``."""
    out, i = [], 0
    while data[i : i + 1] == b"*":
        end = data.index(b"\r\n", i)
        count, i = int(data[i + 1 : end]), end + 2
        args = []
        for _ in range(count):
            end = data.index(b"\r\n", i)
            size, i = int(data[i + 1 : end]), end + 2
            args.append(data[i : i + size])
            i += size + 2
        out.append(args)
    return out


class _FakeRedis:
    """A TCP server answering redis-py's connection set-up as Valkey does (``HELLO`` in the
    protocol asked for, ``OK`` to ``CLIENT ...``), then what it reads with ``answer(data)``:
    bytes to send back (b"" for nothing). ``hellos`` records each HELLO's protocol."""

    def __init__(self, answer: Callable[[bytes], bytes]) -> None:
        self.answer = answer
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.hellos: list[bytes] = []

    def _setup(self, data: bytes) -> bytes | None:
        """The replies to set-up commands, or None when ``data`` is not set-up."""
        if not data.startswith(b"*") or not (b"HELLO" in data or b"CLIENT" in data):
            return None
        out = b""
        for command in _commands(data):
            if command[0].upper() == b"HELLO":
                proto = command[1] if len(command) > 1 else b"2"
                self.hellos.append(proto)
                out += _valkey_hello(proto)
            else:
                out += b"+OK\r\n"
        return out

    async def __aenter__(self) -> _FakeRedis:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    setup = self._setup(data)
                    out = setup if setup is not None else self.answer(data)
                    if out:
                        writer.write(out)
            except ConnectionError:
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def _fake_node(port: int, read_timeout: float = 0.5) -> Node:
    target = parse_target(f"redis://127.0.0.1:{port}/0")
    return Node(target, "", 0, read_timeout=read_timeout)


def test_a_reply_cut_off_midway_fails_the_call_after_the_read_timeout() -> None:
    async def go() -> None:
        async with _FakeRedis(lambda data: b"$10\r\nhal") as fake:  # 3 of 10 bytes, then silence
            node = _fake_node(fake.port)
            try:
                with pytest.raises(TimeoutError):
                    await node.call("GET", "k")
                assert node.links == []
            finally:
                await node.close()

    _run(go)


def test_a_malformed_reply_closes_the_link_and_fails_its_calls() -> None:
    async def go() -> None:
        async with _FakeRedis(lambda data: b"?garbage\r\n") as fake:
            node = _fake_node(fake.port)
            try:
                with pytest.raises(ConnectionError, match="malformed"):
                    await node.call("GET", "k")
                assert node.links == []
            finally:
                await node.close()

    _run(go)


def test_a_reply_nobody_asked_for_closes_the_link() -> None:
    async def go() -> None:
        async with _FakeRedis(lambda data: b"+OK\r\n+EXTRA\r\n") as fake:
            node = _fake_node(fake.port)
            try:
                # The first reply answers the call; the second has no caller: the connection is
                # out of step, so it is closed rather than trusted.
                assert await node.call("PING") in (b"OK", "OK")
                for _ in range(50):
                    if not node.links:
                        break
                    await asyncio.sleep(0.01)
                assert node.links == []
            finally:
                await node.close()

    _run(go)


def test_a_push_message_is_not_taken_for_a_reply() -> None:
    """A RESP3 push (out-of-band: e.g. a maintenance notification) ahead of a reply."""

    async def go() -> list[Any]:
        push = b">3\r\n+MIGRATING\r\n:1\r\n:30\r\n"
        async with _FakeRedis(lambda data: push + b"+OK\r\n") as fake:
            node = _fake_node(fake.port)
            try:
                return [await node.call("PING"), await node.call("PING"), len(node.links)]
            finally:
                await node.close()

    assert _run(go) == [b"OK", b"OK", 1]


def test_a_connection_dropped_midway_fails_the_waiting_calls() -> None:
    async def go() -> None:
        async with _FakeRedis(lambda data: b"") as fake:  # reads, never answers
            node = _fake_node(fake.port, read_timeout=30.0)
            try:
                calls = [asyncio.ensure_future(node.call("ECHO", str(i))) for i in range(3)]
                await asyncio.sleep(0.1)
                assert fake.server is not None
                fake.server.close()
                for link in list(node.links):  # the server side of the socket goes away
                    assert link.transport is not None
                    link.transport.abort()
                results = await asyncio.gather(*calls, return_exceptions=True)
                assert all(isinstance(r, ConnectionError) for r in results), results
            finally:
                await node.close()

    _run(go)
