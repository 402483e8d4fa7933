"""Shared-token authentication: ``Authorization: Bearer <token>`` or HTTP Basic with the token
as the password (any user name).

Basic exists so that unmodified engine clients, which send no auth headers of their own, work
when the token is put in their URL (``http://:TOKEN@host:18000``): the ``requests`` library
turns URL credentials into a Basic header. Comparisons are constant-time and the token is never
logged or echoed; failures are counted (``failures``) for the metrics.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from kvmeta.errors import Unauthorized
from kvmeta.server.http import Request

__all__ = ["TokenAuth", "presented_token"]

_MISSING = (
    "Authentication required: send `Authorization: Bearer <token>`, or put the token in the "
    "server URL as the password (http://:TOKEN@host:port); the server's token is set with "
    "--auth-token / KVMETA_AUTH_TOKEN"
)
_WRONG = (
    "Invalid authentication token: the Bearer token or URL password does not match the "
    "server's --auth-token"
)


class TokenAuth:
    """The ``App.authorize`` hook for one token. Calling it raises ``Unauthorized`` or returns."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must be non-empty; leave auth off instead")
        self._token = token.encode()
        # The headers our own clients and `requests` send, checked first without decoding.
        self._bearer = b"Bearer " + self._token
        self._basic_empty_user = b"Basic " + base64.b64encode(b":" + self._token)
        self.failures = 0

    def __call__(self, request: Request) -> None:
        header = request.authorization
        if header is None:
            self.failures += 1
            raise Unauthorized(_MISSING)
        if hmac.compare_digest(header, self._bearer) or hmac.compare_digest(
            header, self._basic_empty_user
        ):
            return
        if not hmac.compare_digest(presented_token(header), self._token):
            self.failures += 1
            raise Unauthorized(_WRONG)


def presented_token(header: bytes) -> bytes:
    """The token an ``Authorization`` header carries (the Bearer credential or the Basic
    password), or b"" (also used by ``server.access`` for tokens files)."""
    scheme, _, value = header.strip().partition(b" ")
    scheme = scheme.lower()
    value = value.strip()
    if scheme == b"bearer":
        return value
    if scheme == b"basic":
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return b""
        return decoded.partition(b":")[2]
    return b""
