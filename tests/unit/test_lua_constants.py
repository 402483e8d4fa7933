"""Constants the Lua scripts repeat from the Python pool model stay equal."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import kvmeta
import kvmeta.store.redis
from kvmeta.core.pool import RELEASE_GRACE, PoolCounters

LIB = Path(kvmeta.store.redis.__file__).with_name("lua") / "_lib.lua"


def test_release_grace_is_the_same_in_lua() -> None:
    match = re.search(r"^local RELEASE_GRACE = ([0-9.]+)$", LIB.read_text(), re.MULTILINE)
    assert match is not None, f"RELEASE_GRACE not found in {LIB}"
    assert float(match.group(1)) == RELEASE_GRACE


_LUA_DIR = LIB.parent
_COUNTER_NAMES = {f.name for f in dataclasses.fields(PoolCounters)}


def test_the_lua_counts_exactly_the_pool_counters() -> None:
    """A counter the Python pool keeps and the scripts never bump would read 0 on Redis
    forever (and a name the scripts bump that the pool lacks would never be reported)."""
    bumped: set[str] = set()
    for script in _LUA_DIR.glob("*.lua"):
        text = script.read_text()
        bumped |= set(re.findall(r"\bbump\(c, '(\w+)'", text))
        for table in re.findall(r"\bflush\(k, \{([^}]*)\}", text):
            bumped |= set(re.findall(r"(\w+) =", table))
    assert bumped == _COUNTER_NAMES


def test_redis_reports_every_pool_counter_without_a_list_of_its_own() -> None:
    """The Redis stats read the counter names from ``PoolCounters``: a counter added there
    is reported at once (run in a fresh interpreter with an extra counter patched in)."""
    code = (
        "import dataclasses, kvmeta.core.pool as pool\n"
        "@dataclasses.dataclass\n"
        "class Counters(pool.PoolCounters):\n"
        "    brand_new: int = 0\n"
        "pool.PoolCounters = Counters\n"
        "from kvmeta.store.redis import stats as redis\n"
        "assert 'brand_new' in redis.COUNTERS, redis.COUNTERS\n"
    )
    src = str(Path(kvmeta.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    from kvmeta.store.redis import stats as redis

    assert set(redis.COUNTERS) == _COUNTER_NAMES
