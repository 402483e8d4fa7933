"""Where state lives: in this process (optionally journaled) or in Redis/Valkey."""

from kvmeta.store.base import Backend, InitResult, PoolStats
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore

__all__ = ["Backend", "InitResult", "LocalBackend", "MemoryStore", "PoolStats"]
