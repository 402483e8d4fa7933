"""Clients: HTTP (``http``) and in-process, with the engines' class names (``kvmeta.sglang``,
``kvmeta.vllm``)."""
