"""SGLang's client classes, importable where HiCache expects them:
``from kvmeta.sglang import Hf3fsGlobalMetadataClient, Hf3fsLocalMetadataClient``."""

from kvmeta.client.sglang import (
    Hf3fsGlobalMetadataClient,
    Hf3fsLocalMetadataClient,
    Hf3fsMetadataInterface,
)

__all__ = ["Hf3fsGlobalMetadataClient", "Hf3fsLocalMetadataClient", "Hf3fsMetadataInterface"]
