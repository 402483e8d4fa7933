"""Every Redis key a script touches is passed in KEYS (a static check of the Lua sources).

Redis (and Redis Cluster, which routes a script by its KEYS) only knows the keys a script
declares; a script that builds key names inside Lua works on one server but breaks on a
cluster. Scripts get their pools' keys as ``KEYS`` (``store.redis.pool_keys``) and read them
through ``pool_keys_from(KEYS)`` or, for the vLLM index scripts that take several ranks' pools
after the registry keys, ``pool_keys_from(KEYS, first)`` with a computed index; each
``redis.call`` must name its key as a field of that table (``k.stored``, ``k[part]``),
``KEYS[i]``, ``unpack(KEYS, ...)``, or a helper's ``key`` parameter whose callers pass such a
field.
"""

from __future__ import annotations

import re
from importlib import resources

import pytest

from kvmeta._types import PoolId
from kvmeta.store.redis.backend import POOL_PARTS, RedisBackend, pool_keys, pool_prefix
from kvmeta.store.redis.calls import SCRIPTS, TIMED

_LUA = resources.files("kvmeta.store.redis").joinpath("lua")
_KEY_ARG = re.compile(r"^(k\.\w+|k\[\w+\]|KEYS\[\d+\]|key|unpack\(KEYS)$")
_NO_KEY = {"TIME"}
# redis.call('CMD', first-argument ...
_CALL = re.compile(r"redis\.call\(\s*'(\w+)'\s*(?:,\s*([^,)]+))?")
# helpers whose key is their (first / second) argument
_HELPER = re.compile(r"\b(?:call_many|read_many)\(\s*'\w+'\s*,\s*([^,)]+)|\bhmget\(\s*([^,)]+)")
# A call pool_keys_from(arguments), not its definition; one level of parentheses is allowed
# in the arguments: (KEYS, 3 + (i - 1) * width).
_FROM = re.compile(r"(?<!function )\bpool_keys_from\(((?:[^()]|\([^()]*\))*)\)")
# the index into KEYS may be computed, but from numbers and names only: no string, no `..`
_INDEX = re.compile(r"^[\w\s+*/()#-]+$")


def _source(name: str) -> str:
    return _LUA.joinpath(f"{name}.lua").read_text()


def _undeclared(source: str) -> list[str]:
    """Key arguments in ``source`` that do not come from KEYS."""
    bad = []
    for cmd, arg in _CALL.findall(source):
        if cmd.upper() in _NO_KEY:
            continue
        if not _KEY_ARG.match(arg.strip()):
            bad.append(f"redis.call('{cmd}', {arg.strip()}")
    for first, second in _HELPER.findall(source):
        arg = (first or second).strip()
        if arg != "key" and not _KEY_ARG.match(arg):
            bad.append(f"helper key argument {arg}")
    if re.search(r"\bpool_keys\(", source):
        bad.append("pool_keys(prefix) builds key names inside Lua")
    for args in _FROM.findall(source):
        keys, _, first = (part.strip() for part in args.partition(","))
        if keys != "KEYS" or (first and not _INDEX.match(first)):
            bad.append(f"pool_keys_from({args})")
    for match in re.finditer(r"\blocal\s+k\s*=\s*(.+)", source):
        value = match.group(1).strip()
        if value != "{}" and not (value.startswith("pool_keys_from(KEYS") and value.endswith(")")):
            bad.append(f"k = {value}")
    return bad


def _lib_pool_functions() -> str:
    """_lib.lua without the definition of the old dynamic ``pool_keys(p)``, which no script
    calls any more (each script's check refuses a call to it)."""
    lib = _source("_lib")
    if "local function pool_keys(p)" not in lib:
        return lib
    start = lib.index("local function pool_keys(p)")
    end = lib.index("\nend\n", start) + len("\nend\n")
    return lib[:start] + lib[end:]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_scripts_touch_only_keys_passed_in_keys(name: str) -> None:
    assert _undeclared(_source(name)) == []


def test_shared_helpers_touch_only_keys_they_are_given() -> None:
    assert _undeclared(_lib_pool_functions()) == []


def test_the_check_catches_a_name_built_in_lua() -> None:
    assert _undeclared("local k = pool_keys(KEYS[1])\nredis.call('HGET', k.meta, 'n')")
    assert _undeclared("redis.call('HGET', KEYS[1] .. 'meta', 'n')")
    assert _undeclared("call_many('HDEL', prefix .. 'x', args)")
    assert _undeclared("init_pool(pool_keys(v .. 'r' .. ARGV[1] .. ':'), 4)")
    assert _undeclared("local k = pool_keys_from(names, 3)")
    assert _undeclared("local k = pool_keys_from(KEYS, 'r' .. rank)")
    assert _undeclared("local k = pool_keys_from(KEYS, #KEYS .. 'x')")
    assert _undeclared("local k = prefix_keys(KEYS)")
    assert _undeclared("redis.call('UNLINK', unpack(names, 2))")
    assert _undeclared("local k = pool_keys_from(KEYS)\nredis.call('HGET', k.meta, 'n')") == []
    computed = "local k = pool_keys_from(KEYS, 3 + (i - 1) * width)\nflush(k, c)"
    assert _undeclared(computed) == []
    assert _undeclared("init_pool(pool_keys_from(KEYS, 3), 4)") == []
    assert _undeclared("redis.call('UNLINK', unpack(KEYS, 2))") == []


def test_stale_code_is_the_one_the_backend_retries_on() -> None:
    assert f"local STALE = {RedisBackend._V_STALE}\n" in _source("v_exists")


def test_vllm_index_scripts_are_checked() -> None:
    """No script is exempt: the vLLM index scripts take every rank's keys in KEYS too."""
    assert {"v_register", "v_exists", "v_remove", "v_world", "v_index"} <= set(SCRIPTS)


def test_pool_keys_are_the_parts_lua_expects_in_order() -> None:
    lib = _source("_lib")
    parts = re.search(r"local PARTS = \{([^}]*)\}", lib)
    assert parts is not None
    assert tuple(re.findall(r"'(\w+)'", parts.group(1))) == POOL_PARTS
    pool = PoolId("s", 2, "ns")
    assert pool_keys(pool) == tuple(pool_prefix(pool) + part for part in POOL_PARTS)


def test_every_script_that_reads_time_takes_the_test_clock() -> None:
    """A script reading the time does so through ``pool_now(k, ARGV[i], ARGV[i + 1], ...)``
    (the pool's lease clock: the clock-step bound, then the test clock), i one past its own
    arguments as ``store.redis.calls.TIMED`` says, so every server's bound and a backend's test
    clock (the differential test) reach every one; a script not listed there never reads the
    time."""
    for name in SCRIPTS:
        source = _source(name)
        assert "'TIME'" not in source, f"{name}.lua reads TIME directly; use pool_now"
        assert "valkey_time(" not in source, f"{name}.lua reads TIME directly; use pool_now"
        calls = re.findall(r"\bpool_now\(k, ([^,)]*, [^,)]*)", source)
        if name in TIMED:
            i = TIMED[name]
            assert calls == [f"ARGV[{i}], ARGV[{i + 1}]"], f"{name}.lua: {calls}"
        else:
            assert not calls, f"{name}.lua reads the time but is not in store.redis.calls.TIMED"
