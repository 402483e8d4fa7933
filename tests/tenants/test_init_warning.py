"""The "initialised again from another host" warning is about one pool, and a pool belongs to a
tenant: two tenants using the same rank and namespace from different hosts share nothing, so
they get no warning; one tenant's pool initialised from two hosts gets one naming the tenant.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable

from tests.support import Server
from tests.tenants.conftest import bearer, token

AGAIN = "initialised again"


def _post_from(server: Server, source: str, name: str, path: str, body: object) -> int:
    """POST from the loopback address ``source``: the server tells engines apart by host."""
    host, port = server.url.split("://", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30, source_address=(source, 0))
    try:
        headers = {"Content-Type": "application/json", **bearer(token(name))}
        conn.request("POST", path, json.dumps(body), headers)
        return conn.getresponse().status
    finally:
        conn.close()


def test_two_tenants_on_the_same_pool_names_from_two_hosts_do_not_warn(
    tenant_app: Callable[..., Server],
) -> None:
    server = tenant_app("--in-memory")
    sglang = ("/0/initialize", {"num_pages": 8, "namespace": "kv"})
    vllm = ("/rank/0/initialize", {"num_pages": 8})
    for path, body in (sglang, vllm):
        assert _post_from(server, "127.0.0.1", "a_admin", path, body) < 300
        assert _post_from(server, "127.0.0.2", "b_admin", path, body) < 300
    # The same tenant from a second host: the warnings name the tenant's pools ...
    for path, body in (sglang, vllm):
        assert _post_from(server, "127.0.0.3", "a_admin", path, body) < 300
    server.wait_for_log(
        f"tenant 'teamA' rank 0 namespace 'kv' {AGAIN} from 127.0.0.3 (first from 127.0.0.1)"
    )
    server.wait_for_log(f"tenant 'teamA' vllm rank 0 {AGAIN} from 127.0.0.3 (first from 127.0.0.1)")
    # ... and they are the only ones: teamB's initialisations from 127.0.0.2 (logged before
    # them, in the same handler) warned about nothing.
    warnings = [line for line in server.lines if AGAIN in line]
    assert len(warnings) == 2, warnings
