"""Tenants' pools stay apart across SIGKILL and restart: three tenants write the same rank,
namespace and key names into one data directory, the writer is killed with SIGKILL, a real
``kvmeta serve --data-dir`` recovers it, writes more for the default tenant and is killed too;
after the next restart every acknowledged key is in its own tenant's pool at its own page, and
no tenant's key shows up in another's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from kvmeta._types import PoolId
from kvmeta.store.disk.check import check_data_dir
from kvmeta.store.disk.recovery import recover
from tests.support import SRC, ServerProcess

TENANTS = ("", "team-a", "team-b")
WORLD = {"": 1, "team-a": 2, "team-b": 3}

# Writes through the durable backend and the service (there is no HTTP way to pick a tenant
# without a tokens file); prints each acknowledged confirm: "<tenant> <key> <page>".
_WRITER = """
import asyncio, sys
from pathlib import Path
from kvmeta._types import PoolId
from kvmeta.service.ops import Service
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore

async def main():
    backend = LocalBackend(
        MemoryStore(read_lease=0.0),
        DurabilityOptions(data_dir=Path(sys.argv[1]), fsync="always", snapshot_interval=0.0),
    )
    await backend.start()
    svc = Service(backend)
    tenants = ("", "team-a", "team-b")
    for n, tenant in enumerate(tenants):
        pool = PoolId("s", 0, "kv", tenant)
        await svc.initialize(pool, 4096)
        pad = [f"pad{j}" for j in range(n)]  # so that the same key lands on another page
        if pad:
            out = await svc.reserve(pool, pad)
            await svc.confirm(pool, [(k, p) for k, (_, p) in zip(pad, out)], [])
        await svc.v_register(0, 64, n + 1, tenant)
    print("ready", flush=True)
    i = 0
    while True:
        for tenant in tenants:
            pool = PoolId("s", 0, "kv", tenant)
            key = f"k{i}"
            (_, page), = await svc.reserve(pool, [key])
            await svc.confirm(pool, [(key, page)], [])
            print(f"{tenant or '-'} {key} {page}", flush=True)
        i += 1
        if i == 3000:
            await asyncio.sleep(3600)

asyncio.run(main())
"""


def _acked(lines: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {t: {} for t in TENANTS}
    for line in lines:
        parts = line.split()
        if len(parts) == 3:  # a line cut by the kill is not an acknowledgement
            tenant = "" if parts[0] == "-" else parts[0]
            out[tenant][parts[1]] = int(parts[2])
    return out


@pytest.mark.slow
def test_tenants_pools_stay_apart_across_kill_and_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(data)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert writer.stdout is not None
    lines: list[str] = []
    try:
        assert writer.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while len(lines) < 300 and time.monotonic() < deadline:
            line = writer.stdout.readline()
            if not line:
                break
            lines.append(line)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        writer.stdout.close()
    acked = _acked(lines)
    assert all(len(acked[t]) >= 50 for t in TENANTS), {t: len(v) for t, v in acked.items()}
    # The same key names, on different pages per tenant (the pads): a mix-up would show.
    assert acked[""]["k0"] == 0 and acked["team-a"]["k0"] == 1 and acked["team-b"]["k0"] == 2

    server = ServerProcess("--data-dir", str(data), "--fsync", "always").start(timeout=60)
    try:
        keys = sorted(acked[""])
        pages = server.post("/0/get_page_indices", {"keys": keys, "namespace": "kv"}).json()
        assert pages["indices"] == [acked[""][k] for k in keys]
        more = [f"h{j}" for j in range(20)]
        out = server.post(
            "/0/reserve_and_allocate_page_indices",
            {"keys": [[k, ""] for k in more], "namespace": "kv"},
        ).json()["indices"]
        pairs = [[k, page] for k, (_, page) in zip(more, out, strict=True)]
        resp = server.post(
            "/0/confirm_write",
            {"written_keys_to_confirm": pairs, "pages_to_release": [], "namespace": "kv"},
        )
        assert resp.status_code == 204, resp.text
        acked[""].update({k: page for k, page in pairs})
        index = requests.get(server.url + "/v1/vllm", timeout=30).json()
        assert index["ranks"] == [0] and index["world_size"] == WORLD[""]
    finally:
        server.kill()  # SIGKILL

    server = ServerProcess("--data-dir", str(data), "--fsync", "always").start(timeout=60)
    try:
        keys = sorted(acked[""])
        pages = server.post("/0/get_page_indices", {"keys": keys, "namespace": "kv"}).json()
        assert pages["indices"] == [acked[""][k] for k in keys]
    finally:
        assert server.stop() == 0

    state = recover(data, repair=False)
    for n, tenant in enumerate(TENANTS):
        num_pages, entries = state.pools[PoolId("s", 0, "kv", tenant)]
        assert num_pages == 4096
        for key, page in acked[tenant].items():
            assert entries[key] == page, (tenant, key)
        # Only this tenant's own writes: its pads, its k-keys, and (default tenant) the h-keys.
        own = {f"pad{j}" for j in range(n)} | {k for k in entries if k.startswith("k")}
        if tenant == "":
            own |= {f"h{j}" for j in range(20)}
        assert set(entries) == own, tenant
        assert set(entries) >= set(acked[tenant])
        assert PoolId("v", 0, "", tenant) in state.pools
    assert not any(
        k.startswith("h") for t in TENANTS[1:] for k in state.pools[PoolId("s", 0, "kv", t)][1]
    )
    assert state.vworld == 1 and state.tworld == {"team-a": 2, "team-b": 3}
    assert check_data_dir(data).ok
