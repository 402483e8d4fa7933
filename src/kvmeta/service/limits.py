"""Request size limits: each has a flag, a default, and an error that says how to raise it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvmeta.errors import InvalidRequest, PayloadTooLarge

__all__ = ["RequestLimits"]

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:\-]+")


@dataclass(frozen=True)
class RequestLimits:
    """Defaults fit every engine batch seen in the wild (<= 256 keys of <= 80 characters)
    with a wide margin, while keeping one request's CPU time bounded."""

    max_keys: int = 65536
    max_key_length: int = 1024
    max_namespace_length: int = 128
    max_pages: int = 1 << 28

    def check_keys(self, keys: list[str], field: str = "keys") -> None:
        """Raises PayloadTooLarge / InvalidRequest naming the limit and its flag."""
        if len(keys) > self.max_keys:
            raise PayloadTooLarge(
                f"`{field}` has {len(keys)} entries, more than the limit of {self.max_keys} per "
                "request; split the batch or raise --max-keys",
                field,
            )
        limit = self.max_key_length
        if not keys or max(map(len, keys)) <= limit:
            return  # the common case, checked in C; the loop below names the culprit
        for key in keys:
            if len(key) > limit:
                raise InvalidRequest(
                    f"a key in `{field}` is {len(key)} characters long, more than the limit of "
                    f"{limit}; use shorter keys (e.g. a hash) or raise --max-key-length",
                    field,
                )

    def check_namespace(self, namespace: str) -> None:
        if len(namespace) > self.max_namespace_length:
            raise InvalidRequest(
                f"`namespace` is {len(namespace)} characters long, more than the limit of "
                f"{self.max_namespace_length}; use a short pool name or raise "
                "--max-namespace-length",
                "namespace",
            )
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise InvalidRequest(
                f"`namespace` {namespace!r} must be non-empty and use only letters, digits and "
                "`_.:-`; use a plain pool name such as 'kv'",
                "namespace",
            )

    def check_num_pages(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise InvalidRequest(
                f"`num_pages` must be a positive integer, got {num_pages}; pass the number of "
                "pages in the pool's backing file (file size // page size)",
                "num_pages",
            )
        if num_pages > self.max_pages:
            raise InvalidRequest(
                f"`num_pages` {num_pages} exceeds the limit of {self.max_pages}; check the page "
                "size computation or raise --max-pages",
                "num_pages",
            )
