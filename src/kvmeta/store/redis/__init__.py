"""The Redis/Valkey backend: state in Redis, shared by any number of kvmeta servers.

Importing this package needs no redis-py; ``backend`` and the modules it uses do.
"""

__all__: list[str] = []
