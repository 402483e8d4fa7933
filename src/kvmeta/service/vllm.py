"""vLLM's initialisation contract, shared by the dialect-V routes and the in-process client.

vLLM's connector registers each tensor-parallel worker with ``role="worker"`` and the size of
its page file, and the scheduler with ``role="scheduler"`` (which needs nothing). Everything
else is a misconfiguration that the reference server answered with a bare "Invalid
initialization parameters"; here the message adds what was wrong and what is valid, so the one
error users hit most explains itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvmeta.errors import InvalidRequest
from kvmeta.service.limits import show_number

__all__ = [
    "INIT_ERROR",
    "INIT_FIELDS",
    "SCHEDULER_MESSAGE",
    "VALID_INIT",
    "WorkerInit",
    "check_initialize",
    "worker_message",
]

INIT_ERROR = "Invalid initialization parameters: "
SCHEDULER_MESSAGE = "Scheduler role does not require initialization"
VALID_INIT = (
    'valid combinations: {"role": "worker", "num_pages": N} with an integer N > 0 (each '
    'worker: page file size // page size), or {"role": "scheduler"} (num_pages ignored)'
)
INIT_FIELDS = ("role", "num_pages", "world_size")  # what an initialize body may hold
_ROLES = ("worker", "scheduler")
_MISSING: Any = object()


@dataclass(frozen=True)
class WorkerInit:
    """A valid worker registration."""

    rank: int
    num_pages: int
    world_size: int | None


def _show(value: Any) -> str:
    """A value as the caller wrote it (JSON when it came from JSON)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return show_number(value)
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        return repr(value)


def _invalid(what: str, field: str) -> InvalidRequest:
    return InvalidRequest(f"{INIT_ERROR}{what}; {VALID_INIT}", field)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_initialize(
    rank: int, role: Any = "worker", num_pages: Any = _MISSING, world_size: Any = None
) -> WorkerInit | None:
    """Validate an initialize call; None for the scheduler role (nothing to register).

    Raises:
        InvalidRequest: unknown role, or a worker without a positive integer ``num_pages``, or
        a ``world_size`` that is not a positive integer above ``rank``; the message starts
        with ``Invalid initialization parameters: ``.
    """
    if role == "scheduler":
        return None
    if role != "worker":
        hint = ""
        if isinstance(role, str) and role.strip().lower() in _ROLES:
            hint = f" (roles are case-sensitive: did you mean '{role.strip().lower()}'?)"
        raise _invalid(f"unknown role {_show(role)}{hint}", "role")
    if num_pages is _MISSING:
        raise _invalid("role 'worker' needs `num_pages`, which is missing", "num_pages")
    if not _positive_int(num_pages):
        kind = " (a boolean)" if isinstance(num_pages, bool) else ""
        raise _invalid(
            f"`num_pages` must be an integer > 0 for role 'worker', got {_show(num_pages)}{kind}",
            "num_pages",
        )
    if world_size is not None:
        if not _positive_int(world_size):
            raise _invalid(
                f"`world_size` must be an integer > 0 (the tensor-parallel size) or absent, got "
                f"{_show(world_size)}",
                "world_size",
            )
        if not 0 <= rank < world_size:
            raise _invalid(
                f"rank {rank} is outside `world_size` {world_size} (ranks 0..{world_size - 1})",
                "world_size",
            )
    return WorkerInit(rank, num_pages, world_size)


def worker_message(rank: int, num_pages: int, requested: int) -> str:
    """The success message; says so when an existing rank kept a different size."""
    message = f"Rank {rank} initialized with {num_pages} pages"
    if requested != num_pages:
        message += (
            f" (already registered with {num_pages} pages; the requested {requested} is "
            "ignored: resizing would make workers overwrite each other's pages)"
        )
    return message
