"""Where state lives: in this process (optionally journaled) or in Redis/Valkey."""

from kvmeta.store.base import Backend, InitResult, PoolStats
from kvmeta.store.disk.memory import MemoryBackend, MemoryStore

__all__ = ["Backend", "InitResult", "MemoryBackend", "MemoryStore", "PoolStats"]
