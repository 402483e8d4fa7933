"""The HTTP transport both dialects' clients share: one session, a timeout, safe retries,
and server errors mapped back to kvmeta's exception classes with the server's message.

Retries: every kvmeta mutation is idempotent on the wire, so a request is retried after a
connection failure, a timeout or a 5xx, with exponential backoff; a 4xx is never retried (the
same request would fail the same way).

Every reply of a kvmeta server carries ``X-Kvmeta-Epoch`` (the backend's epoch: it changes when
the server's state may have been lost); the transport remembers the last one seen (``epoch``).
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import requests

from kvmeta.client.urls import split_credentials
from kvmeta.errors import KvmetaError, ServerError, ServerUnavailable, error_for_status

__all__ = ["DEFAULT_TIMEOUT", "EPOCH_HEADER", "HttpTransport"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
_RETRY_STATUSES = frozenset({500, 502, 503, 504})
EPOCH_HEADER = "X-Kvmeta-Epoch"


class HttpTransport:
    """POSTs JSON to one kvmeta server.

    ``base_url`` may carry credentials (``http://:TOKEN@host:18000``), sent as HTTP Basic as
    stock engine clients do; ``auth_token`` sends ``Authorization: Bearer``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_retries: int = 3,
        timeout: float | None = DEFAULT_TIMEOUT,
        auth_token: str | None = None,
        backoff: float = 0.1,
        verify: bool | str = True,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        target = split_credentials(base_url.rstrip("/"))
        if urlsplit(target.url).scheme not in ("http", "https"):
            raise ValueError(f"base_url must start with http:// or https://, got {target.shown!r}")
        self.session = requests.Session()
        self.session.verify = verify
        self.verify = verify
        if target.username is not None or target.password is not None:
            user, password = target.username or "", target.password or ""
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.session.headers["Authorization"] = f"Basic {token}"
        if auth_token:
            self.session.headers["Authorization"] = f"Bearer {auth_token}"
        self.base_url = target.url
        self.max_retries = max_retries
        self.timeout = timeout
        self.backoff = backoff
        # The last X-Kvmeta-Epoch seen (None: none yet, or a server that does not send it), and
        # who to tell when a reply carries another one (called with (old, new)).
        self.epoch: str | None = None
        self.on_epoch_change: Callable[[str | None, str], None] | None = None

    def post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """POST ``payload``; returns the decoded JSON reply (None for 204).

        Raises:
            KvmetaError: the subclass matching the server's status, with its message;
            ServerUnavailable: no answer after every retry.
        """
        return self.request("POST", path, payload)

    def get(self, path: str) -> Any:
        return self.request("GET", path, None)

    def request(self, method: str, path: str, payload: dict[str, Any] | None) -> Any:
        url = self.base_url + path
        last: KvmetaError | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff * (2 ** (attempt - 1)), 2.0))
            try:
                # verify per request: requests lets REQUESTS_CA_BUNDLE override session.verify
                resp = self.session.request(
                    method, url, json=payload, timeout=self.timeout, verify=self.verify
                )
            except requests.RequestException as exc:
                last = ServerUnavailable(
                    f"kvmeta server at {self.base_url} did not answer {method} {path} "
                    f"({type(exc).__name__}: {exc}); is `kvmeta serve` running there?"
                )
                logger.debug("attempt %d of %s failed: %s", attempt + 1, path, exc)
                continue
            epoch = resp.headers.get(EPOCH_HEADER)
            if epoch is not None and epoch != self.epoch:
                self._epoch_seen(epoch)
            if resp.status_code < 300:
                return resp.json() if resp.content else None
            detail = _detail(resp)
            if resp.status_code in _RETRY_STATUSES:
                last = ServerError(f"Server error {resp.status_code} on {path}: {detail}")
                continue
            raise error_for_status(resp.status_code, detail)
        assert last is not None
        raise last

    def _epoch_seen(self, epoch: str) -> None:
        old, self.epoch = self.epoch, epoch
        if self.on_epoch_change is not None:
            self.on_epoch_change(old, epoch)

    def close(self) -> None:
        self.session.close()


def _detail(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:500]
