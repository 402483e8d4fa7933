"""kvmeta: a durable KV-cache page metadata service, drop-in for SGLang HiCache and vLLM HF3FS.

Engines import the clients from ``kvmeta.sglang`` and ``kvmeta.vllm``; the server is
``kvmeta serve``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
