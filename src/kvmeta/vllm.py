"""vLLM's client classes, importable where the HF3FS connector expects them:
``from kvmeta.vllm import Hf3fsGlobalMetadataClient, Hf3fsLocalMetadataClient``."""

from kvmeta.client.vllm import (
    Hf3fsGlobalMetadataClient,
    Hf3fsLocalMetadataClient,
    Hf3fsMetadataInterface,
)

__all__ = ["Hf3fsGlobalMetadataClient", "Hf3fsLocalMetadataClient", "Hf3fsMetadataInterface"]
