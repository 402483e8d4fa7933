"""What both HTTP clients share: the transport, and re-initialising a forgotten pool.

``auto_reinitialize=True``: each client remembers the ``initialize`` call that created a pool
(an SGLang ``(rank, namespace)`` or a vLLM worker rank). If the server later answers "not
initialized" for that pool (it restarted without its state), the client repeats that call once,
logs a warning, and retries the request.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from kvmeta.client.http import DEFAULT_TIMEOUT, HttpTransport
from kvmeta.errors import NotInitialized

__all__ = ["RemoteClient"]

logger = logging.getLogger(__name__)


class RemoteClient:
    """Base of the engines' HTTP client classes."""

    def __init__(
        self,
        base_url: str,
        max_retries: int = 3,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        auth_token: str | None = None,
        auto_reinitialize: bool = False,
        verify: bool | str = True,
    ) -> None:
        self.base_url = base_url
        self._http = HttpTransport(
            base_url,
            max_retries=max_retries,
            timeout=timeout,
            auth_token=auth_token,
            verify=verify,
        )
        self.auto_reinitialize = auto_reinitialize
        # pool -> (initialize path, initialize payload), for auto_reinitialize
        self._known: dict[Hashable, tuple[str, dict[str, Any]]] = {}

    def _initialize(self, pool: Hashable, path: str, payload: dict[str, Any]) -> Any:
        reply = self._http.post(path, payload)
        self._known[pool] = (path, payload)
        return reply

    def _post(self, pool: Hashable, path: str, payload: dict[str, Any]) -> Any:
        try:
            return self._http.post(path, payload)
        except NotInitialized:
            init = self._known.get(pool)
            if not self.auto_reinitialize or init is None:
                raise
            init_path, init_payload = init
            logger.warning(
                "kvmeta server at %s forgot %s (restarted without its state?); "
                "re-initialising with %d pages and retrying %s",
                self.base_url,
                pool,
                init_payload["num_pages"],
                path,
            )
            self._http.post(init_path, init_payload)
            return self._http.post(path, payload)

    def close(self) -> None:
        self._http.close()
