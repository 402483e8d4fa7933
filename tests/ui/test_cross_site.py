"""A hostile page in a real browser cannot change a kvmeta server (cross-site request forgery).

The operator signs in to the status page (Basic, the token as password), so the browser holds
the login for the server's origin; then the browser opens a page of another site (a second
local HTTP server, named ``hostile.test`` through Chromium's resolver rules). That page tries
every way a page can send a POST without the server's consent: top-level forms (in new
windows, so they carry the login) in ``text/plain`` whose body is valid JSON and urlencoded
with no fields (an empty body is ``{}``), and ``fetch`` in ``no-cors`` mode asking for
credentials, with a text body and with none; each aims at a different pool's clear route.
Also against a server without a token, which any page could otherwise drive. Every pool must
keep its keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests

from tests.support import ServerProcess

TOKEN = "cross-site-token"
AUTH = ("anyone", TOKEN)
# (dialect, rank, namespace) of each pool the page goes after, one per way of attacking.
TARGETS = (("s", 0, "a"), ("s", 1, "kv"), ("s", 2, "kv"), ("v", 0, ""))

pytestmark = pytest.mark.slow

_PAGE = """<!doctype html>
<html><head><title>loading</title></head><body>
<form id="plain" method="POST" enctype="text/plain" target="_blank" action="{kv}/0/clear">
  <input type="hidden" name='{{"namespace": "a", "pad": "' value='"}}'>
</form>
<form id="urlencoded" method="POST" target="_blank" action="{kv}/1/clear"></form>
<script>
let pending = 2;
const settled = () => {{ if (--pending === 0) document.title = "done"; }};
document.getElementById("plain").submit();
document.getElementById("urlencoded").submit();
const opts = {{ method: "POST", mode: "no-cors", credentials: "include" }};
fetch("{kv}/2/clear", {{ ...opts, body: '{{"namespace": "kv"}}' }}).finally(settled);
fetch("{kv}/clear", opts).finally(settled);
</script>
</body></html>
"""


class HostilePage:
    """A second origin: an HTTP server on another port that serves the attacking page."""

    def __init__(self, kvmeta_url: str) -> None:
        page = _PAGE.format(kv=kvmeta_url).encode()
        self.requests = 0

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HostilePage:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(params=["login", "no-token"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A server with a token (the browser holds the operator's login) or with none."""
    auth = ["--auth-token", TOKEN] if request.param == "login" else []
    proc = ServerProcess("--in-memory", "--access-log", *auth).start()
    try:
        yield proc
    finally:
        proc.stop()


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> requests.Response:
    resp = server.post(path, body, auth=AUTH)  # (a server without a token ignores it)
    assert resp.status_code in (200, 204), (path, resp.status_code, resp.text)
    return resp


def _fill(server: ServerProcess) -> None:
    """Two stored keys in every target pool."""
    for dialect, rank, ns in TARGETS:
        if dialect == "s":
            _post(server, f"/{rank}/initialize", {"num_pages": 8, "namespace": ns})
            got = _post(
                server,
                f"/{rank}/reserve_and_allocate_page_indices",
                {"keys": [["k1", None], ["k2", None]], "namespace": ns},
            ).json()["indices"]
            pairs = [["k1", got[0][1]], ["k2", got[1][1]]]
            _post(
                server,
                f"/{rank}/confirm_write",
                {"written_keys_to_confirm": pairs, "pages_to_release": [], "namespace": ns},
            )
        else:
            _post(server, f"/rank/{rank}/initialize", {"role": "worker", "num_pages": 8})
            confirmations = _post(
                server, "/keys/batch_allocate", {"rank": rank, "keys": [["b1", ""], ["b2", ""]]}
            ).json()["results"]  # [[key, page], ...]
            _post(
                server,
                "/keys/confirm_write",
                {"rank": rank, "confirmations": confirmations, "pages_to_release": []},
            )


def _stored(server: ServerProcess) -> dict[tuple[str, int, str], int]:
    pools = requests.get(server.url + "/v1/pools", auth=AUTH, timeout=30).json()["pools"]
    names = {"sglang": "s", "vllm": "v", "s": "s", "v": "v"}
    return {(names[p["dialect"]], p["rank"], p["namespace"]): p["stored"] for p in pools}


def _wait(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_hostile_page_cannot_clear_pools(
    server: ServerProcess, make_browser: Callable[..., Any]
) -> None:
    _fill(server)
    before = _stored(server)
    assert all(before[t] == 2 for t in TARGETS), before
    kv_origin = server.url  # http://127.0.0.1:PORT
    with HostilePage(kv_origin) as hostile:
        browser = make_browser("--host-resolver-rules=MAP hostile.test 127.0.0.1")
        # The operator's login, cached by the browser for the server's origin.
        host = kv_origin.split("://", 1)[1]
        browser.get(f"http://{AUTH[0]}:{TOKEN}@{host}/ui")
        assert browser.title == "kvmeta status"
        browser.get(f"http://hostile.test:{hostile.port}/")
        _wait("the hostile page's fetches to settle", lambda: browser.title == "done")
        # The forms went to new windows: their requests are done once the server logged them
        # (the fetches carry no login, the browser keeping it for the server's own pages: with
        # a token they are refused 401 before the access log).
        for path in ("/0/clear", "/1/clear"):
            server.wait_for_log(f"POST {path} ", timeout=30)
        assert hostile.requests >= 1
    after = _stored(server)
    assert after == before, f"a cross-site page changed pools: {before} -> {after}"
    # Refused for their Origin (and the forms' bodies are no JSON either).
    for path in ("/0/clear", "/1/clear"):
        assert f"POST {path} 403 " in server.log, server.log


_REBOUND = """
const r = await fetch("/0/clear", {
  method: "POST", headers: {"Content-Type": "application/json"}, body: '{"namespace": "a"}'
});
return [r.status, await r.text()];
"""


def test_rebound_name_cannot_reach_a_loopback_server(
    make_browser: Callable[..., Any], make_server: Callable[..., ServerProcess]
) -> None:
    """DNS rebinding: a name of the attacker's now points at 127.0.0.1, so its page is
    same-origin with a loopback kvmeta (no token) and could read and change everything; the
    server answers no request whose Host is that name."""
    server = make_server("--in-memory")
    _fill(server)
    before = _stored(server)
    browser = make_browser("--host-resolver-rules=MAP rebound.test 127.0.0.1")
    browser.get(f"http://rebound.test:{server.port}/v1/pools")
    shown = browser.find_element("tag name", "body").text
    assert "Host header 'rebound.test:" in shown and '"pools"' not in shown, shown
    status, text = browser.execute_script(_REBOUND)
    assert status == 403 and "DNS rebinding" in text, (status, text)
    assert _stored(server) == before
