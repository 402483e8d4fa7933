"""What both HTTP clients share: the transport, and re-initialising pools a server lost.

``auto_reinitialize=True``: each client remembers the ``initialize`` calls that created its pools
(SGLang ``(rank, namespace)`` pools, vLLM worker ranks) and repeats them when the server may have
lost them, before the call that noticed returns:

- **epoch changed**: every kvmeta reply carries ``X-Kvmeta-Epoch``, which changes exactly when
  the server's state may have been lost or replaced (an in-memory server restarted, a new data
  directory, Redis lost its data). The first reply with a new epoch, whatever the call and even
  a successful one, makes the client repeat *every* remembered ``initialize`` (idempotent: a
  no-op for pools that survived) and log one warning naming both epochs;
- **"not initialized"** for a remembered pool with an unchanged epoch (or from a server that
  sends no epoch): that pool's ``initialize`` is repeated, with a warning, and the call retried.

Without the option nothing is re-sent: the epoch is still tracked (``epoch``) and a change is
logged at INFO.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

from kvmeta.client.http import DEFAULT_TIMEOUT, HttpTransport
from kvmeta.errors import KvmetaError, NotInitialized, ServerError, ServerUnavailable

__all__ = ["RemoteClient"]

logger = logging.getLogger(__name__)

# Epoch changes handled back to back in one call (the server restarting again meanwhile).
_MAX_CATCH_UPS = 3


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
        # An epoch change seen by the transport and not yet acted on: (first old, newest).
        self._changed: tuple[str, str] | None = None
        self._epoch_lock = threading.Lock()
        self._http.on_epoch_change = self._epoch_changed

    @property
    def epoch(self) -> str | None:
        """The server epoch of the last reply (``X-Kvmeta-Epoch``); None before the first reply
        or from a server that does not send one."""
        return self._http.epoch

    def _epoch_changed(self, old: str | None, new: str) -> None:
        """Called by the transport inside a request; acted on once the reply is in."""
        if old is None:
            return  # the first epoch seen: nothing was lost as far as this client knows
        with self._epoch_lock:
            first = self._changed[0] if self._changed is not None else old
            self._changed = (first, new)

    def _catch_up(self) -> bool:
        """Act on an epoch change: repeat every remembered initialize. True if it did."""
        done = False
        for _ in range(_MAX_CATCH_UPS):
            with self._epoch_lock:
                change, self._changed = self._changed, None
            if change is None:
                break
            old, new = change
            if not self.auto_reinitialize:
                logger.info(
                    "kvmeta server at %s has a new epoch (%s -> %s): its state may have been "
                    "lost; auto_reinitialize is off, so nothing is re-sent",
                    self.base_url,
                    old,
                    new,
                )
                break
            known = list(self._known.items())
            logger.warning(
                "kvmeta server at %s has a new epoch (%s -> %s): its state may have been lost "
                "(restart, new data directory, failover); re-initialising %d pool(s)",
                self.base_url,
                old,
                new,
                len(known),
            )
            try:
                for _pool, (path, payload) in known:
                    self._http.post(path, payload)
            except KvmetaError as exc:
                logger.warning("re-initialising after the epoch change failed: %s", exc)
                if isinstance(exc, (ServerError, ServerUnavailable)):
                    with self._epoch_lock:  # try again after the next reply
                        if self._changed is None:
                            self._changed = (old, new)
                break
            done = True
        return done

    def _initialize(self, pool: Hashable, path: str, payload: dict[str, Any]) -> Any:
        try:
            reply = self._http.post(path, payload)
        finally:
            self._catch_up()
        self._known[pool] = (path, payload)
        return reply

    def _post(self, pool: Hashable | None, path: str, payload: dict[str, Any]) -> Any:
        """POST for ``pool`` (None: no pool of its own), re-initialising as the module says."""
        try:
            reply = self._http.post(path, payload)
        except NotInitialized:
            init = self._known.get(pool) if pool is not None else None
            if not self.auto_reinitialize or init is None:
                self._catch_up()
                raise
            if not self._catch_up():
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
            reply = self._http.post(path, payload)
        except KvmetaError:
            self._catch_up()
            raise
        self._catch_up()
        return reply

    def _get(self, path: str) -> Any:
        try:
            return self._http.get(path)
        finally:
            self._catch_up()

    def close(self) -> None:
        self._http.close()
