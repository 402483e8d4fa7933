"""The local backend: pools in this process, optionally journaled to a data directory."""

__all__: list[str] = []
