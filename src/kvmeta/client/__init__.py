"""Clients: HTTP (``http``) and in-process, with the engines' class names (``kvmeta.sglang``,
``kvmeta.vllm``)."""

__all__: list[str] = []  # the modules are imported by name
