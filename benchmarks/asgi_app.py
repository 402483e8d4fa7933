"""kvmeta's app (same routes, service and store) behind a raw ASGI function, for uvicorn.

Only for the serving-stack comparison in README.md: the handler work is identical to
``kvmeta serve``; the difference measured is our ``server/http.py`` versus uvicorn's
httptools protocol + ASGI. Run with::

    PYTHONPATH=src:. uvicorn benchmarks.asgi_app:app --http httptools --loop uvloop \\
        --no-access-log --log-level warning --port 18001
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # only uvicorn runs this module; as a script it explains itself
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvmeta.config import Settings  # noqa: E402
from kvmeta.server.http import Request  # noqa: E402
from kvmeta.server.runner import _limits, build_app, build_backend  # noqa: E402
from kvmeta.service.ops import Service  # noqa: E402

_settings = Settings(in_memory=True, read_lease=0.0)
_app = build_app(_settings, Service(build_backend(_settings), _limits(_settings)))


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    auth = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            auth = value
    request = Request(
        scope["method"], scope["path"], scope["query_string"].decode(), b"".join(chunks), auth
    )
    response = await _app(request)
    headers = [(b"content-type", response.content_type), *response.headers]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="asgi_app.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks/compare_stack.py starts it this way and measures it.",
    )
    parser.parse_args()
    parser.print_help()
