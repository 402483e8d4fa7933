"""vLLM's released HF3FS connector module (``hf3fs_connector.py``), unmodified, with stand-ins for
torch, numpy and the engine modules it imports, so its save path can run against a real server.

Only the metadata traffic is real: ``AsyncOperationManager._handle_save_task`` runs as
released, with the released ``Hf3fsGlobalMetadataClient`` talking HTTP to ``kvmeta serve``;
the GPU gather and the file writes are stand-ins that succeed (``SaveRig``). Nothing of vLLM is
committed: the module comes from the wheel ``stock_clients`` caches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from tests.compat.stock_clients import STOCK, load, member_source

CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_connector.py"
_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1"


class _Anything:
    """Any engine type the module names at import time (a base class, an annotation)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object) -> None:
        pass

    def wait_event(self, *args: object) -> None:
        pass


def _loose(name: str, **attrs: object) -> types.ModuleType:
    """A module whose every other attribute is ``_Anything`` (PEP 562 ``__getattr__``)."""
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__dict__["__getattr__"] = lambda attr: _Anything
    return module


@dataclasses.dataclass
class KVConnectorStats:
    """vLLM's stats base: a dataclass with one ``data`` dict."""

    data: dict[str, Any] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def _stream(*args: object) -> Iterator[None]:
    yield


def _stand_ins(metadata: types.ModuleType) -> dict[str, types.ModuleType]:
    cuda = types.SimpleNamespace(Event=_Anything, stream=_stream, Stream=_Anything)
    modules = {
        "numpy": _loose("numpy"),
        "torch": _loose("torch", cuda=cuda),
        "vllm.logger": _loose("vllm.logger", init_logger=logging.getLogger),
        f"{_PACKAGE}.metrics": _loose(f"{_PACKAGE}.metrics", KVConnectorStats=KVConnectorStats),
        f"{_PACKAGE}.hf3fs.hf3fs_metadata_server": metadata,
    }
    for name in (
        "vllm",
        "vllm.config",
        "vllm.distributed",
        "vllm.distributed.kv_transfer",
        "vllm.distributed.kv_transfer.kv_connector",
        _PACKAGE,
        f"{_PACKAGE}.base",
        f"{_PACKAGE}.hf3fs",
        f"{_PACKAGE}.hf3fs.utils",
        f"{_PACKAGE}.hf3fs.utils.common",
        f"{_PACKAGE}.hf3fs.utils.gather_scatter_helper",
        f"{_PACKAGE}.hf3fs.utils.hf3fs_mock_client",
        "vllm.distributed.parallel_state",
        "vllm.forward_context",
        "vllm.v1",
        "vllm.v1.attention",
        "vllm.v1.attention.backend",
        "vllm.v1.core",
        "vllm.v1.core.kv_cache_manager",
        "vllm.v1.core.sched",
        "vllm.v1.core.sched.output",
        "vllm.v1.kv_cache_interface",
        "vllm.v1.metrics",
        "vllm.v1.metrics.utils",
        "vllm.v1.request",
    ):
        modules.setdefault(name, _loose(name))
    # ``from package import module`` finds the module as the package's attribute.
    modules[f"{_PACKAGE}.hf3fs.utils"].gather_scatter_helper = modules[  # type: ignore[attr-defined]
        f"{_PACKAGE}.hf3fs.utils.gather_scatter_helper"
    ]
    return modules


def load_connector() -> types.ModuleType:
    """Import the released ``hf3fs_connector`` module over the stand-ins."""
    path = member_source(STOCK["vllm"][0], CONNECTOR)
    metadata = load("vllm")
    stand_ins = _stand_ins(metadata)
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("stock_vllm_hf3fs_connector", path)
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


class _File:
    """The page file: every write succeeds (the bytes are not kept)."""

    def __init__(self, bytes_per_page: int) -> None:
        self.bytes_per_page = bytes_per_page
        self.offsets: list[int] = []

    def batch_write(self, offsets: list[int], buffers: list[Any], event: Any) -> list[int]:
        self.offsets += offsets
        return [self.bytes_per_page] * len(offsets)


class _Executor:
    """Runs each submitted write at once."""

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args))
        return future


class _Buffers:
    def alloc_buffer(self, count: int) -> list[None]:
        return [None] * count

    def free_buffer(self, buffers: list[None]) -> None:
        pass


class SaveRig:
    """One worker rank's ``AsyncOperationManager``, built without CUDA, whose
    ``save(block_hashes)`` runs the released ``_handle_save_task`` and returns the task's
    result (True: saved and confirmed)."""

    def __init__(self, connector: types.ModuleType, client: Any, rank: int) -> None:
        self.file = _File(bytes_per_page=64)
        manager = object.__new__(connector.AsyncOperationManager)
        manager._connector = types.SimpleNamespace(
            _metadata_client=client,
            _clients=[self.file],
            _ac=types.SimpleNamespace(next=lambda: 0),
            _gather_or_scatter_kv_caches=lambda *args: None,
        )
        manager._rank = rank
        manager._bytes_per_page = self.file.bytes_per_page
        manager._save_buffer_allocator = _Buffers()
        manager._save_stream = _Anything()
        manager._io_executor = _Executor()
        manager.hf3fs_stats = connector.HF3FSKVConnectorStats()
        self.manager = manager

    def save(self, request_id: str, block_hashes: list[str]) -> bool:
        future: Future[bool] = Future()
        block_ids = list(range(len(block_hashes)))
        self.manager._handle_save_task((request_id, block_ids, block_hashes, future, _Anything()))
        return future.result(timeout=0)
