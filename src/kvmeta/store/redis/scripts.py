"""kvmeta's Lua code on a Redis deployment: one Functions library, or EVALSHA scripts.

Why a Functions library: Redis keeps functions with the data (they are replicated to replicas
and saved in RDB/AOF), so a replica promoted by Sentinel or Cluster failover already has every
operation, while the EVALSHA script cache is per process and empty on a new primary. Where the
server has no ``FUNCTION`` command (Redis < 7, or an ACL that refuses it) the same code runs as
one EVALSHA script per operation, loaded again on ``NOSCRIPT``.

The sources stay one file per operation in ``store/redis/lua/`` plus ``_lib.lua`` (helpers every
operation uses). An op file is a script body: it reads ``KEYS``/``ARGV`` and ends with a
``return``. As a script it runs as ``_lib.lua`` + the op file; in the library ``_lib.lua`` comes
once at the top and each op file becomes the body of ``function(KEYS, ARGV) ... end``, so the
same text works both ways unchanged.

Versioning: the library has a function ``kvmeta_version`` returning ``"FORMAT:HASH"``.
``LIBRARY_FORMAT`` is bumped when the calling convention changes (function names, KEYS/ARGV
or reply shapes); HASH covers the whole library source. ``install`` replaces an older format, or
the same format with another hash (another build of the same convention), and refuses a newer
format: a newer kvmeta shares this Redis and this one must be upgraded, never the reverse.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from kvmeta.errors import BackendUnavailable

__all__ = ["LIBRARY_FORMAT", "LIBRARY_NAME", "ScriptLibrary"]

logger = logging.getLogger(__name__)

# One command on the node being set up (``Node.call``): its reply, or its error raised.
Call = Callable[..., Awaitable[Any]]

LIBRARY_NAME = "kvmeta"
# Bump when a function's name, KEYS/ARGV layout or reply shape changes incompatibly: a server of
# an older format must not keep calling a library of a newer one (see ``install``).
# 2: the change-feed flag argument (the test clock moved one ARGV on); 3: meta 'exp', the
# lower bound of lease ends every lease write keeps (a format-2 script would not lower it);
# 4: the pool's hash index, an eleventh pool key (KEYS) that every script storing or removing
# keys maintains when meta 'hx' or 'hb' (being built) says so, initialize's ARGV[2] and ARGV[3]
# and its reply's 4th element (walk the pool to build its index), and hidx_fill (a format-3
# script would neither take the key nor keep the index); 5: one server walks a build
# (initialize's ARGV[4] and ARGV[5], hidx_fill's ARGV[3] and ARGV[4] and its reply [2]: a
# format-4 server would walk every build it is asked to, and fail to pass the claim); 6:
# v_remove's ARGV[2] is its force flag (the feed flag and the test clock moved one on) and its
# reply [5, ...] refuses a rank whose pages are in use (a format-5 server would pass its feed
# flag as force, and not know the refusal); initialize and v_register answer [4, part, ...] when
# a pool's keys are left without its meta (a format-5 server cannot read that reply, and its
# library would create the pool over them); 7: leases are measured with each pool's lease clock
# (meta lt and lo, _lib.lua pool_now), which a step of Valkey's wall clock cannot move, and
# written STEP_BOUND longer (a format-6 script would compare lease ends with Valkey's TIME and
# end them early by the clock's lag, or late); initialize's ARGV[6] and v_register's ARGV[4],
# the end of the hold after a data loss (meta hold, which reserve honours), and hold (a
# format-6 script would create a pool handing out page 0 while a writer of the lost data may
# still write it); 8: v_exists is one span of ranks of a walk (ARGV[2] the number of required
# ranks, ARGV[3] whether the world size pins them, KEYS the span's pools, the reply the
# positions of the keys still complete), and v_register's ARGV[5] says whether the caller may
# change the world size, refused as [10, world size] (a format-7 server would pass its
# required ranks as ARGV[2], and its write tokens could change the world size); 9: reserve's
# request carries a third element, 1 for a vLLM batch that is all or nothing (a format-8
# script would grant part of such a batch)
LIBRARY_FORMAT = 9
_FUNCTION_PREFIX = "kvmeta_"
_VERSION_FUNCTION = "kvmeta_version"
# Ops that never change what a caller was promised, so a caller need not wait for replicas
# after them. exists/v_exists bump hit counters and stats expires leases, but a lost counter is
# only a statistic and an expiry is recomputed from the time by the next call. hidx_release
# lets go of a server's claim on an index build's walk as it closes: lost in a failover, the
# claim is taken over once stale instead of at once, and closing waits for no replica.
_NO_STATE_CHANGE = frozenset({"exists", "v_exists", "stats", "check", "v_index", "hidx_release"})
# Ops whose code issues no write command at all: registered ``no-writes``, so they also run
# where writes are refused (a replica, a primary short of ``min-replicas-to-write``). A write
# from one of them fails loudly ("Write commands are not allowed from read-only scripts").
_NO_WRITES = frozenset({"check", "v_index"})
# How often install re-reads the version after a lost race with another process's load.
_INSTALL_ROUNDS = 5


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_version(value: str) -> tuple[int, str]:
    """``"FORMAT:HASH"`` -> (FORMAT, HASH); anything unreadable counts as format 0 (older)."""
    head, _, digest = value.partition(":")
    return (int(head), digest) if head.isdecimal() else (0, value)


def _read_sources() -> tuple[str, dict[str, str]]:
    lua = resources.files("kvmeta.store.redis").joinpath("lua")
    ops = {
        item.name[: -len(".lua")]: item.read_text()
        for item in lua.iterdir()
        if item.name.endswith(".lua") and not item.name.startswith("_")
    }
    return lua.joinpath("_lib.lua").read_text(), dict(sorted(ops.items()))


class ScriptLibrary:
    """kvmeta's Lua code on a Redis deployment: one Functions library where the server has
    FUNCTION (Valkey / Redis >= 7), else the same code as EVALSHA scripts.

    One instance serves every node of a deployment (a cluster's primaries are one server
    version); the mode (functions or scripts) is decided by the first ``install``.
    """

    names: tuple[str, ...]

    def __init__(self, *, functions: bool | None = None) -> None:
        """``functions=None``: use Functions if the first node installed on has them;
        ``False``: always EVALSHA (tests, or a deployment that must not hold a library)."""
        lib, ops = _read_sources()
        self.names = tuple(ops)
        self._functions = functions
        # Scripts exactly as they have always been loaded: _lib.lua, a newline, the op file.
        self._scripts = {name: lib + "\n" + text for name, text in ops.items()}
        self._shas = {
            name: hashlib.sha1(src.encode()).hexdigest() for name, src in self._scripts.items()
        }
        body = [f"#!lua name={LIBRARY_NAME}", lib]
        for name, text in ops.items():
            flags = ", flags={'no-writes'}" if name in _NO_WRITES else ""
            body.append(
                f"redis.register_function{{function_name='{_FUNCTION_PREFIX}{name}'{flags}, "
                f"callback=function(KEYS, ARGV)\n{text}\nend}}"
            )
        source = "\n".join(body) + "\n"
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        self.version = f"{LIBRARY_FORMAT}:{digest}"
        self.source = source + (
            f"redis.register_function{{function_name='{_VERSION_FUNCTION}', flags={{'no-writes'}}, "
            f"callback=function() return '{self.version}' end}}\n"
        )

    @property
    def functions(self) -> bool | None:
        """True: FCALL; False: EVALSHA; None: not decided yet (no install so far)."""
        return self._functions

    def writes(self, name: str) -> bool:
        """True if the op can change page state, so an acknowledgement must wait for replicas
        after it. False for exists, v_exists, stats, check and v_index: they only bump
        statistics counters or expire leases, which a failover may lose at no cost (the next
        call recomputes expiry from the time); and for hidx_release, whose loss in a failover
        only delays the taking over of a walk until its claim is stale.

        Raises:
            KeyError: ``name`` is not an operation.
        """
        if name not in self._scripts:
            raise KeyError(name)
        return name not in _NO_STATE_CHANGE

    def command(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """The command that runs op ``name``; the caller packs and sends it (and may pipeline a
        WAIT after it). Before the first install it is FCALL unless functions were refused."""
        if self._functions is False:
            return ("EVALSHA", self._shas[name], len(keys), *keys, *args)
        return ("FCALL", _FUNCTION_PREFIX + name, len(keys), *keys, *args)

    @staticmethod
    def missing(exc: BaseException) -> bool:
        """True if ``exc`` says the node lacks kvmeta's code: ``NOSCRIPT`` (a restarted or
        flushed script cache), ``Function not found`` (a node that never got the library, or
        ``FUNCTION FLUSH``), or an unknown ``FCALL`` (a server without Functions, before the
        first install decided). The caller runs ``install`` on that node and retries once."""
        if isinstance(exc, NoScriptError):
            return True
        if not isinstance(exc, ResponseError):
            return False
        text = str(exc).lower()
        # Redis 6 quotes the command with backticks, Valkey and Redis 7 with single quotes.
        unknown_fcall = text.startswith("unknown command") and "fcall" in text.split(",")[0]
        return text.startswith("function not found") or unknown_fcall

    async def install(self, call: Call) -> str:
        """Make one node (a primary) current; returns a short text for a log line.

        Safe to call concurrently from several kvmeta processes: a load that loses the race
        ("already exists") re-reads the version and acts on what it finds.

        Raises:
            BackendUnavailable: the node holds a library of a newer format (a newer kvmeta uses
                this Redis); it is left in place.
            RedisError, OSError: the node failed (the caller maps these as for any call).
        """
        if self._functions is not False:
            try:
                await call("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY_NAME)
            except ResponseError as exc:
                text = str(exc).lower()
                if "unknown command" not in text and "noperm" not in text:
                    raise
                if self._functions is None:
                    logger.info("Redis has no FUNCTION command (%s): using EVALSHA scripts", exc)
                self._functions = False
            else:
                self._functions = True
        if not self._functions:
            for source in self._scripts.values():
                await call("SCRIPT", "LOAD", source)
            return f"{len(self._scripts)} kvmeta scripts loaded (EVALSHA)"
        return await self._install_library(call)

    async def _install_library(self, call: Call) -> str:
        replaced: str | None = None
        for _ in range(_INSTALL_ROUNDS):
            found = await self._installed_version(call)
            if found == self.version:
                if replaced is None:
                    return f"functions library {LIBRARY_NAME} {self.version} current"
                return f"functions library {LIBRARY_NAME} {self.version} replaced {replaced}"
            if found is None:
                load: tuple[str, ...] = ("FUNCTION", "LOAD", self.source)
            else:
                fmt, _ = _parse_version(found)
                if fmt > LIBRARY_FORMAT:
                    raise BackendUnavailable(
                        f"Redis holds kvmeta functions library version {found}, newer than this "
                        f"server's {self.version}: another kvmeta of a newer version uses this "
                        "Redis, so this kvmeta server must be upgraded to that version (the "
                        "newer library is left in place: replacing it would break those servers)"
                    )
                load = ("FUNCTION", "LOAD", "REPLACE", self.source)
            try:
                await call(*load)
            except ResponseError as exc:
                if "already exists" in str(exc):
                    continue  # another process loaded one just now: look again
                raise
            if found is not None:
                replaced = found or "an unversioned library"
                logger.warning(
                    "replaced kvmeta functions library %s with %s (%s)",
                    replaced,
                    self.version,
                    "an older calling convention"
                    if _parse_version(found)[0] < LIBRARY_FORMAT
                    else "another build of the same calling convention",
                )
            else:
                return f"functions library {LIBRARY_NAME} {self.version} loaded"
        raise BackendUnavailable(
            f"the kvmeta functions library kept changing while loading {self.version}: "
            "kvmeta servers of different versions are replacing each other's library on this "
            "Redis; run one kvmeta version per Redis"
        )

    async def _installed_version(self, call: Call) -> str | None:
        """The node's library version; None: no library; "" (format 0): one without a version
        function, from before libraries were versioned."""
        listed = await call("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY_NAME)
        if not _named(listed):
            return None
        try:
            return _text(await call("FCALL", _VERSION_FUNCTION, 0))
        except ResponseError as exc:
            if ScriptLibrary.missing(exc):
                return ""
            raise


def _named(listed: Any) -> bool:
    """Whether a FUNCTION LIST LIBRARYNAME reply names exactly ``kvmeta`` (the argument is a
    glob pattern; the reply is a list of flat field/value lists, or dicts under RESP3)."""
    for lib in listed or ():
        fields = (
            list(lib.items())
            if isinstance(lib, dict)
            else list(zip(lib[::2], lib[1::2], strict=True))
        )
        for key, value in fields:
            if _text(key) == "library_name" and _text(value) == LIBRARY_NAME:
                return True
    return False
