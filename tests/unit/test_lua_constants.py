"""Constants the Lua scripts repeat from the Python pool model stay equal."""

from __future__ import annotations

import re
from pathlib import Path

import kvmeta.store
from kvmeta.core.pool import RELEASE_GRACE

LIB = Path(kvmeta.store.__file__).with_name("lua") / "_lib.lua"


def test_release_grace_is_the_same_in_lua() -> None:
    match = re.search(r"^local RELEASE_GRACE = ([0-9.]+)$", LIB.read_text(), re.MULTILINE)
    assert match is not None, f"RELEASE_GRACE not found in {LIB}"
    assert float(match.group(1)) == RELEASE_GRACE
