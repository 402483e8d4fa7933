"""Small shared value types; imports nothing from kvmeta so every layer may use it."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DEFAULT_NAMESPACE", "PoolId", "sglang_pool", "vllm_pool"]

DEFAULT_NAMESPACE = "kv"


class PoolId(NamedTuple):
    """Names one pool. ``dialect`` keeps SGLang pools (``"s"``) and vLLM per-rank pools
    (``"v"``, namespace ``""``) apart, so the same rank numbers never collide."""

    dialect: str
    rank: int
    namespace: str

    def __str__(self) -> str:
        if self.dialect == "v":
            return f"vllm rank {self.rank}"
        return f"rank {self.rank} namespace '{self.namespace}'"


def sglang_pool(rank: int, namespace: str = DEFAULT_NAMESPACE) -> PoolId:
    return PoolId("s", rank, namespace)


def vllm_pool(rank: int) -> PoolId:
    return PoolId("v", rank, "")
