"""vLLM's HF3FS metadata clients, same class names and signatures, kvmeta behaviour.

``Hf3fsGlobalMetadataClient`` talks to ``kvmeta serve`` (dialect V); ``Hf3fsLocalMetadataClient``
keeps the same index in this process. Both raise kvmeta's error classes (all ``RuntimeError``,
which is what vLLM's connector catches) carrying the server's message, time out, and retry only
what is safe to retry, exactly like the SGLang clients in ``client.sglang``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmeta._types import PoolId
from kvmeta.client._local import LocalState
from kvmeta.client._remote import RemoteClient
from kvmeta.client.http import DEFAULT_TIMEOUT
from kvmeta.errors import KvmetaError

__all__ = ["Hf3fsGlobalMetadataClient", "Hf3fsLocalMetadataClient", "Hf3fsMetadataInterface"]


KeyLike = tuple[str, str | None] | list[Any] | str


def _key(entry: KeyLike) -> str:
    """vLLM passes ``(key, prefix_key)`` pairs; a bare key is accepted too."""
    return entry if isinstance(entry, str) else str(entry[0])


def _first_prefix(keys: Sequence[KeyLike]) -> str | None:
    """The first pair's prefix key (None: a bare key, none or empty): an eviction hint."""
    if not keys or isinstance(keys[0], str) or len(keys[0]) < 2:
        return None
    prefix = keys[0][1]
    return str(prefix) if prefix else None


class Hf3fsMetadataInterface:
    """The methods vLLM's HF3FS connector calls; both clients implement all of them."""

    def initialize(
        self, rank: int, num_pages: int = 0, role: str = "worker", *, world_size: int | None = None
    ) -> None:
        """Register a worker rank's page file, or do nothing for ``role="scheduler"``.

        ``world_size`` (a kvmeta extension) pins which ranks make a key complete: 0..N-1.
        """
        raise NotImplementedError

    def allocate_pages_for_keys(self, rank: int, keys: Sequence[KeyLike]) -> list[tuple[str, int]]:
        """One ``(key, page)`` per requested key, in order; page -1 when none can be had."""
        raise NotImplementedError

    def confirm_write_for_keys(
        self,
        rank: int,
        key_confirmations: Sequence[tuple[str, int]],
        pages_to_release: Sequence[int] | None = None,
    ) -> None:
        raise NotImplementedError

    def batch_key_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored on every worker rank."""
        raise NotImplementedError

    def get_key_locations(self, rank: int, keys: Sequence[str]) -> list[int | None]:
        raise NotImplementedError

    def clear(self) -> None:
        """Drop every key; worker registrations stay (a kvmeta addition to vLLM's client)."""
        raise NotImplementedError

    # kvmeta additions for operators ---------------------------------------------------------

    def remove_rank(self, rank: int, force: bool = False) -> bool:
        """Deregister a worker rank (a stray or retired one) and drop its keys; False when it
        was not registered. A rank that registers again starts empty.

        Raises:
            RankInUse: its pages are still reserved or being read (a worker of that rank is at
                work, or died less than a lease ago); nothing was changed. ``force`` removes it
                anyway: only for workers that are gone for good.
        """
        raise NotImplementedError

    def set_world_size(self, world_size: int | None) -> None:
        """Pin the ranks a key needs to ``0..world_size-1``; None unpins them (then the
        contiguous registered ranks from 0 count)."""
        raise NotImplementedError

    def rank_registry(self) -> dict[str, Any]:
        """``world_size``, ``ranks``, ``required``, ``ignored`` and ``missing`` ranks."""
        raise NotImplementedError


class Hf3fsGlobalMetadataClient(RemoteClient, Hf3fsMetadataInterface):
    """HTTP client for ``kvmeta serve`` (or any server speaking vLLM's dialect).

    ``auto_reinitialize=True``: the client remembers each worker rank's ``initialize`` arguments
    and, if the server answers "not initialized" (it restarted without its state), registers the
    rank again once, logs a warning and repeats the call.
    """

    def __init__(
        self,
        base_url: str = "http://localhost:18000",
        max_retries: int = 3,
        timeout: float | None = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> None:
        """vLLM's signature (the URL has a default); ``options`` as ``RemoteClient``."""
        super().__init__(base_url, max_retries, timeout, **options)

    def _call(self, rank: int, path: str, payload: dict[str, Any]) -> Any:
        return self._post(PoolId("v", rank, ""), path, payload)

    def initialize(
        self, rank: int, num_pages: int = 0, role: str = "worker", *, world_size: int | None = None
    ) -> None:
        payload: dict[str, Any] = {"num_pages": num_pages, "role": role}
        if world_size is not None:
            payload["world_size"] = world_size
        path = f"/rank/{rank}/initialize"
        if role == "worker":
            self._initialize(PoolId("v", rank, ""), path, payload)
        else:
            self._post(None, path, payload)

    def allocate_pages_for_keys(self, rank: int, keys: Sequence[KeyLike]) -> list[tuple[str, int]]:
        pairs = [[k, None] if isinstance(k, str) else list(k) for k in keys]
        reply = self._call(rank, "/keys/batch_allocate", {"rank": rank, "keys": pairs})
        return [(str(key), int(page)) for key, page in reply["results"]]

    def confirm_write_for_keys(
        self,
        rank: int,
        key_confirmations: Sequence[tuple[str, int]],
        pages_to_release: Sequence[int] | None = None,
    ) -> None:
        payload = {
            "rank": rank,
            "confirmations": [list(p) for p in key_confirmations],
            "pages_to_release": list(pages_to_release or []),
        }
        self._call(rank, "/keys/confirm_write", payload)

    def batch_key_exists(self, keys: Sequence[str]) -> list[bool]:
        reply = self._post(None, "/keys/batch_exists", {"keys": list(keys)})
        return list(reply["exists"])

    def get_key_locations(self, rank: int, keys: Sequence[str]) -> list[int | None]:
        reply = self._call(rank, "/keys/get_locations", {"rank": rank, "keys": list(keys)})
        return list(reply["locations"])

    def clear(self) -> None:
        self._post(None, "/clear", {})

    def remove_rank(self, rank: int, force: bool = False) -> bool:
        # Forgotten first: auto_reinitialize must not bring it back, not even when this very
        # reply carries a new epoch.
        pool = PoolId("v", rank, "")
        init = self._known.pop(pool, None)
        query = "?force=true" if force else ""
        try:
            reply = self._post(None, f"/v1/vllm/ranks/{int(rank)}/remove{query}", {})
        except KvmetaError:
            if init is not None:
                self._known[pool] = init
            raise
        return bool(reply["removed"])

    def set_world_size(self, world_size: int | None) -> None:
        self._post(None, "/v1/vllm/world_size", {"world_size": world_size})

    def rank_registry(self) -> dict[str, Any]:
        return dict(self._get("/v1/vllm"))


class Hf3fsLocalMetadataClient(LocalState, Hf3fsMetadataInterface):
    """The same index in this process, no server: for a single-node engine.

    Thread-safe (one lock); state is lost when the process exits. Errors are the server's:
    same class, same message (both run the ``Service``).
    """

    def initialize(
        self, rank: int, num_pages: int = 0, role: str = "worker", *, world_size: int | None = None
    ) -> None:
        self._warned(self._service.v_initialize(rank, role, num_pages, world_size))

    def allocate_pages_for_keys(self, rank: int, keys: Sequence[KeyLike]) -> list[tuple[str, int]]:
        plain = [_key(k) for k in keys]
        pool = PoolId("v", rank, "")
        out = self._warned(self._service.v_allocate(pool, plain, _first_prefix(keys)))
        return [(key, page) for key, (_hit, page) in zip(plain, out, strict=True)]

    def confirm_write_for_keys(
        self,
        rank: int,
        key_confirmations: Sequence[tuple[str, int]],
        pages_to_release: Sequence[int] | None = None,
    ) -> None:
        pairs = [(str(k), int(p)) for k, p in key_confirmations]
        release = [int(p) for p in pages_to_release or []]
        self._warned(self._service.confirm(PoolId("v", rank, ""), pairs, release))

    def batch_key_exists(self, keys: Sequence[str]) -> list[bool]:
        return self._run(self._service.v_exists(list(keys)))

    def get_key_locations(self, rank: int, keys: Sequence[str]) -> list[int | None]:
        return self._run(self._service.get(PoolId("v", rank, ""), list(keys)))

    def clear(self) -> None:
        self._run(self._service.v_clear())

    def remove_rank(self, rank: int, force: bool = False) -> bool:
        return self._run(self._service.v_remove(rank, "", force)) is not None

    def set_world_size(self, world_size: int | None) -> None:
        self._run(self._service.v_set_world_size(world_size))

    def rank_registry(self) -> dict[str, Any]:
        return self._run(self._service.v_index()).view()
