"""How a request presents its token: ``Authorization: Bearer <token>`` or HTTP Basic with the
token as the password (any user name). ``server.access`` checks it (``--auth-token`` and the
tokens file alike).

Basic exists so that unmodified engine clients, which send no auth headers of their own, work
when the token is put in their URL (``http://:TOKEN@host:18000``): the ``requests`` library
turns URL credentials into a Basic header. A token is compared by its digest
(``server.tokens``), never logged nor echoed.
"""

from __future__ import annotations

import base64
import binascii

__all__ = ["presented_token"]


def presented_token(header: bytes) -> bytes:
    """The token an ``Authorization`` header carries (the Bearer credential or the Basic
    password), or b"" (none: refused as an invalid token)."""
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
