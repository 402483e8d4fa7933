"""Load the engines' own, unmodified metadata clients for drop-in tests.

The client classes live in each engine's reference metadata-server module. Installing the
engines (torch, CUDA wheels) is far too heavy, so the released wheel is fetched once with
``pip download`` into a cache outside the repository, the one module is extracted, and it is
imported with stand-ins for the imports its *server* half needs (FastAPI) and for the engine
types it names (SGLang's ``PoolName`` str-Enum and its abstract interface). The client code
itself runs exactly as released. Nothing of the engines is committed to this repository.
"""

from __future__ import annotations

import abc
import enum
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("KVMETA_TEST_CACHE", Path.home() / ".cache" / "kvmeta-tests"))

STOCK = {
    "sglang": ("sglang==0.5.23", "sglang/srt/mem_cache/storage/hf3fs/mini_3fs_metadata_server.py"),
    "vllm": (
        "vllm==0.34.0",
        "vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_metadata_server.py",
    ),
}


def module_source(engine: str) -> Path:
    """Path of the engine's metadata-server module, downloading its wheel on first use."""
    requirement, member = STOCK[engine]
    target = CACHE / requirement.replace("==", "-") / Path(member).name
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
            data = zf.read(member)
    partial = target.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(target)
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


def _stand_ins() -> dict[str, types.ModuleType]:
    class _Any:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    class Hf3fsMetadataInterface(abc.ABC):  # noqa: B024 - the engine's base has abstract methods
        pass

    fastapi = _stub("fastapi", FastAPI=_Any, HTTPException=Exception, Request=_Any, Response=_Any)
    return {
        "fastapi": fastapi,
        "fastapi.responses": _stub("fastapi.responses", ORJSONResponse=_Any),
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
