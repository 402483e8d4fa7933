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
from kvmeta.store.base import VIndex

__all__ = [
    "INIT_ERROR",
    "INIT_FIELDS",
    "SCHEDULER_MESSAGE",
    "VALID_INIT",
    "WORLD_SIZE_USAGE",
    "WorkerInit",
    "check_initialize",
    "check_world_size_body",
    "completeness",
    "ignored_rank_warning",
    "remove_message",
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


# ---------------------------------------------------------------------- operating the rank registry

WORLD_SIZE_USAGE = (
    'Send {"world_size": N} with N the tensor-parallel size (ranks 0..N-1 make a block '
    'complete), or {"world_size": null} to unset it'
)


def check_world_size_body(data: Any) -> int | None:
    """The world size of a ``POST /v1/vllm/world_size`` body (None: unset it).

    Raises:
        InvalidRequest: not an object, no ``world_size`` field, or not a positive integer/null.
    """
    if not isinstance(data, dict):
        raise InvalidRequest(
            f"the body must be a JSON object, got {type(data).__name__}. {WORLD_SIZE_USAGE}",
            "world_size",
        )
    if "world_size" not in data:
        raise InvalidRequest(
            f"need `world_size`, which is missing. {WORLD_SIZE_USAGE}", "world_size"
        )
    value = data["world_size"]
    if value is not None and not _positive_int(value):
        kind = " (a boolean)" if isinstance(value, bool) else ""
        raise InvalidRequest(
            f"`world_size` must be an integer > 0 or null, got {_show(value)}{kind}. "
            + WORLD_SIZE_USAGE,
            "world_size",
        )
    return value  # type: ignore[no-any-return]


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def completeness(index: VIndex) -> str:
    """Which ranks make a block complete now, in one sentence."""
    if index.world_size is not None:
        text = f"world_size {index.world_size}: blocks are complete when stored on ranks " + _span(
            index.required
        )
        if index.missing:
            text += (
                f"; rank(s) {', '.join(map(str, index.missing[:8]))} not registered, so no "
                "block is complete until they are"
            )
        return text
    if not index.required:
        return "no world_size and rank 0 is not registered: no block is complete until it is"
    return (
        "no world_size: blocks are complete when stored on the registered ranks "
        f"{_span(index.required)} (the contiguous run from 0)"
    )


def remove_message(rank: int, dropped: int | None, index: VIndex) -> str:
    """The reply to a rank removal, with what completeness now means."""
    if dropped is None:
        return f"Rank {rank} is not registered: nothing to remove. Now {completeness(index)}"
    return (
        f"Rank {rank} removed: its registration and its {dropped} stored key(s) are gone (if it "
        f"registers again it starts empty). Now {completeness(index)}"
    )


def ignored_rank_warning(rank: int, index: VIndex) -> str | None:
    """The log line for a registered rank that does not count for completeness, or None."""
    if rank not in index.ignored:
        return None
    fix = (
        f"if the registration is a mistake, remove it: POST /v1/vllm/ranks/{rank}/remove "
        "(kvmeta's client: remove_rank)"
    )
    if index.world_size is not None:
        why = f"world_size is {index.world_size} (ranks 0..{index.world_size - 1})"
    elif rank < 0:
        why = "worker ranks are counted from 0"
    else:
        why = (
            f"ranks 0..{rank - 1} are not all registered (normal for a moment while workers "
            "start; otherwise pin the ranks with POST /v1/vllm/world_size)"
        )
    return f"vLLM worker rank {rank} does not count for completeness: {why}; {fix}"
