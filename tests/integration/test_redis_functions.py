"""kvmeta's Lua code as one Redis Functions library (``store.redis.scripts.ScriptLibrary``),
on a real server: loaded once per primary and replicated with the data, so a promoted replica
already has it; versioned, so an older library is replaced and a newer one is never clobbered;
with the EVALSHA fallback for servers without FUNCTION."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from importlib import resources
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import NoScriptError, ResponseError

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable
from kvmeta.store.redis.backend import RedisBackend
from kvmeta.store.redis.scripts import LIBRARY_FORMAT, LIBRARY_NAME, ScriptLibrary
from tests.redis_support import RedisServer

T = TypeVar("T")


def _run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@pytest.fixture
def fresh(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The session's Redis with no data, no functions and no cached scripts."""
    with redis_server.client() as client:
        client.flushall()
        client.function_flush()
        client.script_flush()
    yield redis_server
    with redis_server.client() as client:
        client.function_flush()


async def _connect(server: RedisServer) -> AbstractConnection:
    conn = aioredis.Connection(host="127.0.0.1", port=server.port)
    await conn.connect()
    return conn


async def _call(conn: AbstractConnection, *args: Any) -> Any:
    await conn.send_command(*args)
    return await conn.read_response()


def _version(server: RedisServer) -> str:
    with server.client() as client:
        return str(client.fcall("kvmeta_version", 0).decode())


def _fake_library(version: str, *, with_version: bool = True) -> str:
    """A tiny library named like kvmeta's, as another kvmeta version would have left it."""
    body = f"#!lua name={LIBRARY_NAME}\n"
    body += "redis.register_function('kvmeta_exists', function(keys, args) return 'old' end)\n"
    if with_version:
        body += f"redis.register_function('kvmeta_version', function() return '{version}' end)\n"
    return body


class _LibraryBackend(RedisBackend):
    """The Redis backend with every script call made through a ``ScriptLibrary`` on a
    connection of its own: install on first use, and again whenever the node lacks the code
    (``missing``), as the production call path does."""

    def __init__(self, url: str, library: ScriptLibrary) -> None:
        super().__init__(url, functions=library.functions)  # start() installs in its mode
        self.library = library
        self.conn: AbstractConnection | None = None
        self.installs = 0
        self.installed: list[str] = []  # install()'s texts
        self.commands: list[str] = []

    async def _run(self, script: str, keys: str | tuple[str, ...], args: list[Any]) -> list[Any]:
        if self.conn is None:
            parsed = redis.connection.parse_url(self.url)
            self.conn = aioredis.Connection(host=parsed["host"], port=parsed["port"])
            await self.conn.connect()
            await self._install()
        names = (keys,) if isinstance(keys, str) else tuple(keys)
        for attempt in range(2):
            cmd = self.library.command(script, names, args)
            self.commands.append(str(cmd[0]))
            try:
                raw = await _call(self.conn, *cmd)
                break
            except ResponseError as exc:
                if attempt or not self.library.missing(exc):
                    raise
                await self._install()
        reply: list[Any] = json.loads(raw)
        return reply

    async def _install(self) -> None:
        assert self.conn is not None
        self.installs += 1
        self.installed.append(await self.library.install(functools.partial(_call, self.conn)))

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.disconnect()
            self.conn = None
        await super().close()


def _op_files() -> set[str]:
    lua = resources.files("kvmeta.store.redis").joinpath("lua")
    return {p.name[:-4] for p in lua.iterdir() if p.name.endswith(".lua") and p.name[0] != "_"}


async def _every_op(backend: RedisBackend) -> None:
    """Drive every backend operation once, so every script runs."""
    pool = PoolId("s", 0, "ns")
    assert (await backend.initialize(pool, 8)).created
    assert await backend.exists(pool, ["a", "b"]) == [False, False]
    reserved = await backend.reserve(pool, ["a", "b"])
    assert [done for done, _ in reserved] == [False, False]  # (already stored?, page)
    assert (
        await backend.confirm(pool, [(k, p) for k, (_, p) in zip("ab", reserved, strict=True)], [])
        == 0
    )
    assert await backend.exists(pool, ["a", "b", "c"]) == [True, True, False]
    assert (await backend.get(pool, ["a", "c"]))[1] is None
    assert await backend.delete(pool, ["a"]) == 1
    [stats] = [s for s in await backend.stats() if s.pool == pool]
    assert stats.stored == 1
    assert (await backend.check()).problems == []
    assert await backend.clear(pool) == 1
    await backend.v_register(0, 4, 2)
    await backend.v_register(1, 4, None)
    assert await backend.v_exists(["x"]) == [False]
    await backend.v_set_world_size(2)
    assert (await backend.v_index()).ranks == (0, 1)
    assert await backend.v_remove(1) is not None
    assert await backend.v_clear() >= 0


def _backend_run(server: RedisServer, library: ScriptLibrary, body: Callable[..., Any]) -> Any:
    async def main() -> Any:
        backend = _LibraryBackend(server.url, library)
        await backend.start()
        try:
            return await body(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


# ---------------------------------------------------------------------------------- the library


def test_names_are_every_op_file_and_writes_marks_state_changes() -> None:
    library = ScriptLibrary()
    assert set(library.names) == _op_files()
    unacknowledged = {"exists", "v_exists", "stats", "check", "v_index", "hidx_release"}
    assert {n for n in library.names if not library.writes(n)} == unacknowledged
    with pytest.raises(KeyError):
        library.writes("no_such_op")


def test_every_op_runs_as_a_function(fresh: RedisServer) -> None:
    library = ScriptLibrary()

    async def body(backend: _LibraryBackend) -> None:
        await _every_op(backend)
        assert set(backend.commands) == {"FCALL"}
        assert backend.installs == 1

    _backend_run(fresh, library, body)
    with fresh.client() as client:
        [lib] = client.function_list(library=LIBRARY_NAME)
    functions = [_fields(f) for f in _fields(lib)["functions"]]
    listed = {_text(f["name"]): [_text(x) for x in f["flags"]] for f in functions}
    assert set(listed) == {f"kvmeta_{n}" for n in library.names} | {"kvmeta_version"}
    # Only code that never writes may run read-only (on a replica, or with too few replicas).
    assert {n for n, flags in listed.items() if "no-writes" in flags} <= {
        "kvmeta_check",
        "kvmeta_v_index",
        "kvmeta_version",
    }
    assert _version(fresh) == library.version
    assert library.version.startswith(f"{LIBRARY_FORMAT}:")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(reply: Any) -> dict[str, Any]:
    """A FUNCTION LIST map as a dict (a dict under RESP3, a flat list under RESP2)."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {_text(k): v for k, v in pairs}


def test_install_is_idempotent(fresh: RedisServer) -> None:
    library = ScriptLibrary()

    async def main() -> list[str]:
        conn = await _connect(fresh)
        try:
            call = functools.partial(_call, conn)
            return [await library.install(call), await library.install(call)]
        finally:
            await conn.disconnect()

    first, second = _run(main())
    assert "loaded" in first
    assert "current" in second
    assert _version(fresh) == library.version


def test_a_flushed_library_is_missing_then_reinstalled(fresh: RedisServer) -> None:
    library = ScriptLibrary()

    async def body(backend: _LibraryBackend) -> None:
        pool = PoolId("s", 0, "ns")
        await backend.initialize(pool, 4)
        with fresh.client() as client:
            client.function_flush()  # as on a node that never had it
        assert await backend.exists(pool, ["a"]) == [False]
        assert backend.installs == 2
        # The raw error a caller sees first: missing() recognises it.
        conn = await _connect(fresh)
        try:
            await _call(conn, "FUNCTION", "FLUSH")
            with pytest.raises(ResponseError) as info:
                await _call(conn, *library.command("exists", ("k",), ["[]"]))
            assert library.missing(info.value), str(info.value)
            assert "Function not found" in str(info.value)
        finally:
            await conn.disconnect()

    _backend_run(fresh, library, body)


def test_missing_recognises_only_lost_code() -> None:
    assert ScriptLibrary.missing(NoScriptError("No matching script."))
    assert ScriptLibrary.missing(ResponseError("Function not found"))
    assert ScriptLibrary.missing(ResponseError("unknown command 'FCALL', with args beginning"))
    assert ScriptLibrary.missing(ResponseError("unknown command `FCALL`, with args beginning"))
    assert not ScriptLibrary.missing(ResponseError("unknown command 'FOO', with args: 'fcall'"))
    assert not ScriptLibrary.missing(ResponseError("WRONGTYPE Operation against a key"))
    assert not ScriptLibrary.missing(ResponseError("user_function:12: Script attempted to..."))
    assert not ScriptLibrary.missing(ConnectionError("gone"))


@pytest.mark.parametrize(
    "old",
    [
        _fake_library(f"{LIBRARY_FORMAT - 1}:0123456789abcdef"),  # an older calling convention
        _fake_library(f"{LIBRARY_FORMAT}:0123456789abcdef"),  # same convention, other code
        _fake_library("", with_version=False),  # before libraries carried a version
    ],
    ids=["older-format", "other-hash", "unversioned"],
)
def test_another_older_library_is_replaced(
    fresh: RedisServer, old: str, caplog: pytest.LogCaptureFixture
) -> None:
    with fresh.client() as client:
        client.function_load(old)
    library = ScriptLibrary()

    async def main() -> str:
        conn = await _connect(fresh)
        try:
            return await library.install(functools.partial(_call, conn))
        finally:
            await conn.disconnect()

    with caplog.at_level(logging.WARNING, logger="kvmeta.store.redis.scripts"):
        text = _run(main())
    assert "replaced" in text
    assert _version(fresh) == library.version
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "replaced" in warning.getMessage() and library.version in warning.getMessage()

    async def body(backend: _LibraryBackend) -> None:
        await _every_op(backend)

    _backend_run(fresh, library, body)


def test_a_newer_library_is_never_replaced(fresh: RedisServer) -> None:
    newer = f"{LIBRARY_FORMAT + 1}:fedcba9876543210"
    with fresh.client() as client:
        client.function_load(_fake_library(newer))
    library = ScriptLibrary()

    async def main() -> str:
        conn = await _connect(fresh)
        try:
            return await library.install(functools.partial(_call, conn))
        finally:
            await conn.disconnect()

    with pytest.raises(BackendUnavailable) as info:
        _run(main())
    message = str(info.value)
    assert "newer" in message and "upgrade" in message and newer in message
    assert _version(fresh) == newer  # left in place for the newer servers using it


def test_concurrent_installs_all_succeed(fresh: RedisServer) -> None:
    async def install_many() -> list[str]:
        conns = [await _connect(fresh) for _ in range(4)]
        try:
            return await asyncio.gather(
                *(ScriptLibrary().install(functools.partial(_call, c)) for c in conns)
            )
        finally:
            for conn in conns:
                await conn.disconnect()

    texts = _run(install_many())
    assert len(texts) == 4
    assert _version(fresh) == ScriptLibrary().version
    # ... and again over an older library, which every process then wants to replace.
    with fresh.client() as client:
        client.function_load(_fake_library("0:old"), replace=True)
    _run(install_many())
    assert _version(fresh) == ScriptLibrary().version


# ---------------------------------------------------------------------------------- EVALSHA


def test_scripts_without_functions_survive_script_flush(fresh: RedisServer) -> None:
    library = ScriptLibrary(functions=False)

    async def body(backend: _LibraryBackend) -> None:
        await _every_op(backend)
        with fresh.client() as client:
            client.script_flush()
        pool = PoolId("s", 1, "ns")
        await backend.initialize(pool, 4)
        assert await backend.exists(pool, ["a"]) == [False]
        assert set(backend.commands) == {"EVALSHA"}
        assert backend.installs == 2

    _backend_run(fresh, library, body)
    with fresh.client() as client:
        assert client.function_list(library=LIBRARY_NAME) == []


def test_a_server_without_function_gets_scripts() -> None:
    """A server where FUNCTION is unavailable (Redis < 7, or an ACL / rename hiding it)."""
    server = RedisServer("--rename-command", "FUNCTION", "").start()
    try:
        library = ScriptLibrary()

        async def body(backend: _LibraryBackend) -> None:
            await _every_op(backend)
            assert set(backend.commands) == {"EVALSHA"}

        _backend_run(server, library, body)
    finally:
        server.close()


def test_command_shapes() -> None:
    keys: Sequence[str] = ("k1", "k2")
    fcall = ScriptLibrary().command("reserve", keys, ["x"])
    assert fcall == ("FCALL", "kvmeta_reserve", 2, "k1", "k2", "x")
    evalsha = ScriptLibrary(functions=False).command("reserve", keys, ["x"])
    lua = resources.files("kvmeta.store.redis").joinpath("lua")
    source = lua.joinpath("_lib.lua").read_text() + "\n" + lua.joinpath("reserve.lua").read_text()
    sha = hashlib.sha1(source.encode()).hexdigest()  # the script EVALSHA has always run
    assert evalsha == ("EVALSHA", sha, 2, "k1", "k2", "x")


def test_a_replica_has_the_library_and_serves_it_once_promoted(fresh: RedisServer) -> None:
    """What Functions are for: the library travels with the data, so after a failover the new
    primary runs every op with no install (the EVALSHA cache would be empty there)."""
    replica = RedisServer("--replicaof", "127.0.0.1", str(fresh.port)).start()
    try:
        library = ScriptLibrary()

        async def install() -> str:
            conn = await _connect(fresh)
            try:
                return await library.install(functools.partial(_call, conn))
            finally:
                await conn.disconnect()

        _wait_for(lambda: _linked(replica), "the replica's initial sync")
        _run(install())
        _wait_for(lambda: _has_library(replica), "the library on the replica")
        assert _version(replica) == library.version
        with replica.client() as client:
            client.execute_command("REPLICAOF", "NO", "ONE")  # promoted, as by a failover

        async def body(backend: _LibraryBackend) -> None:
            await _every_op(backend)
            assert backend.installs == 1
            assert "current" in backend.installed[0]  # nothing loaded: it was already there
            assert set(backend.commands) == {"FCALL"}

        _backend_run(replica, library, body)
    finally:
        replica.close()


def _linked(replica: RedisServer) -> bool:
    with replica.client() as client:
        return client.info("replication").get("master_link_status") == "up"


def _has_library(server: RedisServer) -> bool:
    with server.client() as client:
        return bool(client.function_list(library=LIBRARY_NAME))


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
