"""SGLang HiCache's metadata clients, same class names and signatures, kvmeta behaviour.

``Hf3fsGlobalMetadataClient`` talks to ``kvmeta serve``; ``Hf3fsLocalMetadataClient`` keeps the
pools in this process. Every method takes ``namespace`` last (a str or a str-valued Enum),
defaulting to the KV pool, like SGLang's own clients.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from enum import Enum
from typing import Any, TypeVar

from kvmeta._types import DEFAULT_NAMESPACE, PoolId, normalize_namespace
from kvmeta.client._local import LocalState
from kvmeta.client._remote import RemoteClient
from kvmeta.errors import NotInitialized

__all__ = ["Hf3fsGlobalMetadataClient", "Hf3fsLocalMetadataClient", "Hf3fsMetadataInterface"]


NamespaceLike = str | Enum
T = TypeVar("T")


def _ns(namespace: NamespaceLike | None) -> str:
    if namespace is None:
        return DEFAULT_NAMESPACE
    if isinstance(namespace, Enum):
        return str(namespace.value)
    return normalize_namespace(str(namespace))


class Hf3fsMetadataInterface:
    """The methods HiCache calls; both clients implement all of them."""

    def initialize(
        self, rank: int, num_pages: int, namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> None:
        raise NotImplementedError

    def reserve_and_allocate_page_indices(
        self,
        rank: int,
        keys: Sequence[tuple[str, str | None]],
        namespace: NamespaceLike = DEFAULT_NAMESPACE,
    ) -> list[tuple[bool, int]]:
        raise NotImplementedError

    def confirm_write(
        self,
        rank: int,
        written_keys_to_confirm: Sequence[tuple[str, int]],
        pages_to_release: Sequence[int],
        namespace: NamespaceLike = DEFAULT_NAMESPACE,
    ) -> None:
        raise NotImplementedError

    def get_page_indices(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> list[int | None]:
        raise NotImplementedError

    def delete_keys(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> None:
        raise NotImplementedError

    def exists(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> list[bool]:
        raise NotImplementedError

    def clear(self, rank: int, namespace: NamespaceLike = DEFAULT_NAMESPACE) -> None:
        raise NotImplementedError


class Hf3fsGlobalMetadataClient(RemoteClient, Hf3fsMetadataInterface):
    """HTTP client for ``kvmeta serve`` (or any server speaking SGLang's dialect).

    ``auto_reinitialize=True``: the client remembers each pool's ``initialize`` arguments and,
    if the server answers "not initialized" (it restarted without its state), initialises the
    pool again once, logs a warning and repeats the call.
    """

    def _call(self, rank: int, ns: str, op: str, payload: dict[str, Any]) -> Any:
        payload["namespace"] = ns
        return self._post(PoolId("s", rank, ns), f"/{rank}/{op}", payload)

    def initialize(
        self, rank: int, num_pages: int, namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> None:
        ns = _ns(namespace)
        payload = {"num_pages": num_pages, "namespace": ns}
        self._initialize(PoolId("s", rank, ns), f"/{rank}/initialize", payload)

    def reserve_and_allocate_page_indices(
        self,
        rank: int,
        keys: Sequence[tuple[str, str | None]],
        namespace: NamespaceLike = DEFAULT_NAMESPACE,
    ) -> list[tuple[bool, int]]:
        reply = self._call(
            rank,
            _ns(namespace),
            "reserve_and_allocate_page_indices",
            {"keys": [list(k) for k in keys]},
        )
        return [(bool(hit), int(page)) for hit, page in reply["indices"]]

    def confirm_write(
        self,
        rank: int,
        written_keys_to_confirm: Sequence[tuple[str, int]],
        pages_to_release: Sequence[int],
        namespace: NamespaceLike = DEFAULT_NAMESPACE,
    ) -> None:
        self._call(
            rank,
            _ns(namespace),
            "confirm_write",
            {
                "written_keys_to_confirm": [list(p) for p in written_keys_to_confirm],
                "pages_to_release": list(pages_to_release),
            },
        )

    def get_page_indices(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> list[int | None]:
        reply = self._call(rank, _ns(namespace), "get_page_indices", {"keys": list(keys)})
        return list(reply["indices"])

    def delete_keys(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> None:
        self._call(rank, _ns(namespace), "delete_keys", {"keys": list(keys)})

    def exists(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> list[bool]:
        reply = self._call(rank, _ns(namespace), "exists", {"keys": list(keys)})
        return list(reply["exists"])

    def clear(self, rank: int, namespace: NamespaceLike = DEFAULT_NAMESPACE) -> None:
        self._call(rank, _ns(namespace), "clear", {})


class Hf3fsLocalMetadataClient(LocalState, Hf3fsMetadataInterface):
    """The same pools in this process, no server: for a single-node engine.

    Thread-safe (one lock); state is lost when the process exits. Errors are the server's:
    same class, same message (both run the ``Service``), except "not initialized", which
    SGLang's own in-process client words differently from its server.
    """

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return super()._run(coro)
        except NotInitialized as exc:
            if exc.rank is None or exc.namespace is None:
                raise
            raise NotInitialized.in_process(exc.rank, exc.namespace) from None

    def initialize(
        self, rank: int, num_pages: int, namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> None:
        self._warned(self._service.initialize(PoolId("s", rank, _ns(namespace)), num_pages))

    def reserve_and_allocate_page_indices(
        self,
        rank: int,
        keys: Sequence[tuple[str, str | None]],
        namespace: NamespaceLike = DEFAULT_NAMESPACE,
    ) -> list[tuple[bool, int]]:
        plain = [k[0] for k in keys]
        parent = keys[0][1] if keys else None  # an eviction hint (``Service.reserve``)
        return self._run(self._service.reserve(PoolId("s", rank, _ns(namespace)), plain, parent))

    def confirm_write(
        self,
        rank: int,
        written_keys_to_confirm: Sequence[tuple[str, int]],
        pages_to_release: Sequence[int],
        namespace: NamespaceLike = DEFAULT_NAMESPACE,
    ) -> None:
        pairs = [(str(k), int(p)) for k, p in written_keys_to_confirm]
        release = [int(p) for p in pages_to_release]
        self._warned(self._service.confirm(PoolId("s", rank, _ns(namespace)), pairs, release))

    def get_page_indices(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> list[int | None]:
        return self._run(self._service.get(PoolId("s", rank, _ns(namespace)), list(keys)))

    def delete_keys(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> None:
        self._run(self._service.delete(PoolId("s", rank, _ns(namespace)), list(keys)))

    def exists(
        self, rank: int, keys: Sequence[str], namespace: NamespaceLike = DEFAULT_NAMESPACE
    ) -> list[bool]:
        return self._run(self._service.exists(PoolId("s", rank, _ns(namespace)), list(keys)))

    def clear(self, rank: int, namespace: NamespaceLike = DEFAULT_NAMESPACE) -> None:
        self._run(self._service.clear(PoolId("s", rank, _ns(namespace))))
