"""deploy/kubernetes, rendered as ``kubectl kustomize`` renders each overlay (or, where kubectl
is missing, by the small renderer below, which is checked against kubectl where both exist),
then held against the real server: every flag and ``KVMETA_*`` variable the pods use exists and
starts a server, every probe path answers a client without a token while auth is on, ports,
volumes, Secrets and the tokens-file copy fit together, and the pods run as the image's user."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import requests
import yaml

from kvmeta.errors import ConfigError
from kvmeta.server.tokens import load_tokens
from tests.deploy import product
from tests.deploy.test_dockerfile import _one
from tests.support import ServerProcess

KUBE = product.ROOT / "deploy" / "kubernetes"
OVERLAYS = {"durable": "StatefulSet", "valkey": "Deployment"}
DOCS = product.ROOT / "docs" / "deployment.md"
Doc = dict[str, Any]


# -- rendering ------------------------------------------------------------------------------


def _load(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _render_here(directory: Path) -> list[Doc]:
    """What kustomize makes of ``directory`` with the features these files use: resources,
    components and JSON patches with a kind/name target."""
    spec = _load(directory / "kustomization.yaml")[0]
    known = {"apiVersion", "kind", "resources", "components", "patches"}
    assert set(spec) <= known, f"{directory}: the fallback renderer lacks {set(spec) - known}"
    docs: list[Doc] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += _render_here(path) if path.is_dir() else _load(path)
    for entry in spec.get("components", []):
        component = _load(directory / entry / "kustomization.yaml")[0]
        assert component["kind"] == "Component"
        docs = _patched(docs, directory / entry, component)
    return _patched(docs, directory, spec)


def _patched(docs: list[Doc], directory: Path, spec: Doc) -> list[Doc]:
    for entry in spec.get("patches", []):
        target, ops = entry["target"], _load(directory / entry["path"])[0]
        assert set(target) == {"kind", "name"}, f"the fallback renderer lacks {target}"
        for doc in docs:
            if (doc["kind"], doc["metadata"]["name"]) == (target["kind"], target["name"]):
                for op in ops:
                    _json_patch(doc, op)
    return docs


def _json_patch(doc: Doc, op: Doc) -> None:
    *parents, last = op["path"].split("/")[1:]
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(op.get("value"))
    if op["op"] == "add" and isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), value)
    elif op["op"] in ("add", "replace"):
        node[int(last) if isinstance(node, list) else last] = value
    else:
        raise AssertionError(f"the fallback renderer does not do {op['op']!r}")


def _render_kubectl(directory: Path) -> list[Doc] | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render(overlay: str) -> list[Doc]:
    directory = KUBE / "overlays" / overlay
    return _render_kubectl(directory) or _render_here(directory)


def _by_id(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_fallback_renderer_agrees_with_kubectl() -> None:
    for overlay in OVERLAYS:
        ours = _by_id(_render_here(KUBE / "overlays" / overlay))
        theirs = _render_kubectl(KUBE / "overlays" / overlay)
        # kubectl is part of the machines CI runs on; a machine without it fails here.
        assert theirs is not None, "kubectl is not on PATH: install it to check the renderer"
        assert ours == _by_id(theirs), overlay


# -- what the pods run ----------------------------------------------------------------------


def _workload(overlay: str) -> Doc:
    docs = render(overlay)
    (workload,) = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    assert workload["kind"] == OVERLAYS[overlay] and workload["metadata"]["name"] == "kvmeta"
    return workload


def _pod(overlay: str) -> Doc:
    pod: Doc = _workload(overlay)["spec"]["template"]["spec"]
    return pod


def _server(overlay: str) -> Doc:
    (container,) = [c for c in _pod(overlay)["containers"] if c["name"] == "kvmeta"]
    return container


def _env(container: Doc) -> dict[str, str]:
    """The container's variables, a Secret's value standing in as a placeholder."""
    placeholders = {"kvmeta-valkey/url": "redis+sentinel://:pw@s1:26379,s2:26379/kvmeta"}
    out = {}
    for var in container.get("env", []):
        if "value" in var:
            out[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            out[var["name"]] = placeholders.get(f"{ref['name']}/{ref['key']}", "x" * 32)
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_and_variable_is_the_servers_and_starts_it(overlay: str) -> None:
    container = _server(overlay)
    command, args = container["command"], container["args"]
    assert command[:2] == ["kvmeta", "serve"], command
    argv = command[2:] + args
    assert not product.unknown_flags(argv), product.serve_help()
    env = _env(container)
    unknown = sorted(set(env) - product.serve_env())
    assert not unknown, f"kvmeta serve reads no {unknown}: {sorted(product.serve_env())}"
    settings = product.resolve(argv, env)
    assert settings.host == "0.0.0.0"
    (port,) = container["ports"]
    assert port == {"name": "http", "containerPort": settings.port}
    assert settings.port == product.default_port()
    assert env["KVMETA_AUTH_TOKEN"] and settings.auth_token  # auth is on
    if overlay == "durable":
        assert settings.data_dir == product.DATA_DIR and not settings.backend
    else:
        assert settings.backend.startswith("redis") and settings.workers > 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_servers_open_routes_and_port(overlay: str) -> None:
    container = _server(overlay)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    paths = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["httpGet"]
        assert set(probe) == {"path", "port"}, f"{kind}: no headers, no https ({probe})"
        assert ports[probe["port"]] == product.default_port()
        paths[kind] = probe["path"]
    assert paths == {
        "startupProbe": "/ready",
        "readinessProbe": "/ready",
        "livenessProbe": "/health",
    }
    # Liveness is not stricter than readiness: a server out of rotation is not restarted.
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > (
        ready["periodSeconds"] * ready["failureThreshold"]
    )


def _run_pod(overlay: str, tmp: Path, backend: str) -> ServerProcess:
    """The server container's own command line and variables, run here: the data directory
    and the tokens file (the init container's copy) in ``tmp``, the Secrets' values made up,
    the backend a local Valkey, a free port. It binds every interface, as in the pod."""
    container = _server(overlay)
    argv = [
        str(tmp / "data") if arg == product.DATA_DIR else arg
        for arg in container["command"][2:] + container["args"]
    ]
    env = _env(container)
    env["KVMETA_AUTH_TOKEN"] = product.TOKEN
    env["KVMETA_AUTH_FILE"] = str(product.write_tokens_file(tmp / "tokens.toml"))
    if "KVMETA_BACKEND" in env:
        env["KVMETA_BACKEND"] = backend
    return ServerProcess(*argv, "--port", "0", env=env, cwd=tmp).start()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_probes_pass_on_the_pods_own_command_line(
    overlay: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Each probe as the kubelet sends it: no token, ``Host`` the pod's IP and port. The valkey
    overlay's servers wait for a replica's acknowledgement (--min-replicas-ack 1): their
    backend is a primary with a replica."""
    backend = ""
    if overlay == "valkey":
        backend = request.getfixturevalue("replica_pair").primary.url
    server = _run_pod(overlay, tmp_path, backend)
    try:
        base = f"http://127.0.0.1:{server.port}"
        kubelet = {"Host": "10.244.1.7:18000", "User-Agent": "kube-probe/1.32"}
        container = _server(overlay)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = container[kind]["httpGet"]["path"]
            got = requests.get(base + path, headers=kubelet, timeout=30)
            assert got.status_code == 200, f"{kind} {path}: {got.status_code} {got.text}"
        ready = requests.get(base + "/ready", headers=kubelet, timeout=30)
        assert ready.json() == {"ready": True}  # nothing about the backend without a token
        # Auth is on: the other routes need the token (the operator's, or a tenant's).
        assert requests.get(base + "/v1/pools", headers=kubelet, timeout=30).status_code == 401
        bearer = {**kubelet, "Authorization": f"Bearer {product.TOKEN}"}
        assert requests.get(base + "/v1/pools", headers=bearer, timeout=30).ok
        engine = requests.post(
            base + "/0/initialize", json={"num_pages": 8}, auth=("", "tenant-token-of-team-a"),
            headers={"Host": "kvmeta.default.svc:18000"}, timeout=30,
        )  # fmt: skip
        assert engine.status_code in (200, 204), engine.text
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_reaches_the_pods(overlay: str) -> None:
    docs = _by_id(render(overlay))
    workload = _workload(overlay)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = docs[("Service", "kvmeta")]["spec"]
    assert service["selector"].items() <= labels.items()
    assert service.get("type", "ClusterIP") == "ClusterIP"
    (port,) = service["ports"]
    assert port["port"] == product.default_port() and port["targetPort"] == "http"
    account = docs[("ServiceAccount", "kvmeta")]
    assert account["automountServiceAccountToken"] is False
    assert _pod(overlay)["serviceAccountName"] == "kvmeta"
    if overlay == "durable":
        governing = docs[("Service", workload["spec"]["serviceName"])]["spec"]
        assert governing["clusterIP"] == "None"


def test_the_durable_overlay_is_one_server_on_its_own_volume() -> None:
    workload = _workload("durable")["spec"]
    assert workload["replicas"] == 1
    (claim,) = workload["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["mountPath"]: m["name"] for m in _server("durable")["volumeMounts"]}
    assert mounts[product.DATA_DIR] == claim["metadata"]["name"]


def test_the_valkey_overlay_is_stateless_servers_on_a_secret_url() -> None:
    workload = _workload("valkey")["spec"]
    assert workload["replicas"] >= 2
    assert workload["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    mounts = [m["mountPath"] for m in _server("valkey")["volumeMounts"]]
    assert product.DATA_DIR not in mounts
    (backend,) = [v for v in _server("valkey")["env"] if v["name"] == "KVMETA_BACKEND"]
    assert backend["valueFrom"]["secretKeyRef"] == {"name": "kvmeta-valkey", "key": "url"}
    budget = _by_id(render("valkey"))[("PodDisruptionBudget", "kvmeta")]["spec"]
    assert budget["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pods_run_as_the_images_user_with_room_to_stop(overlay: str) -> None:
    pod = _pod(overlay)
    uid, gid = (int(x) for x in _one("USER").split(":"))
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (uid, gid, gid)
    for container in pod["containers"] + pod.get("initContainers", []):
        own = container["securityContext"]
        assert own["allowPrivilegeEscalation"] is False and own["capabilities"]["drop"] == ["ALL"]
        assert own["readOnlyRootFilesystem"] is True
        assert container["image"] == _server(overlay)["image"]
    server = _server(overlay)
    assert server["resources"]["requests"]["cpu"] and server["resources"]["limits"]["memory"]
    # The grace period covers the preStop pause and the shutdown after it.
    pause = server["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(pause[1]) + 20


# -- Secrets and the tokens file ------------------------------------------------------------


def _secret_refs(pod: Doc) -> set[str]:
    refs = set()
    for container in pod["containers"] + pod.get("initContainers", []):
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add(f"{ref['name']}/{ref['key']}")
    for volume in pod["volumes"]:
        if "secret" in volume:
            secret = volume["secret"]
            refs |= {f"{secret['secretName']}/{item['key']}" for item in secret["items"]}
    return refs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_key_used_is_one_the_docs_create(overlay: str) -> None:
    docs = DOCS.read_text().replace("\\\n", " ")  # continued shell lines joined
    created: set[str] = set()
    for command in re.findall(r"kubectl create secret generic [^\n]*", docs):
        name = command.split()[4]
        created |= {f"{name}/{key}" for key in re.findall(r"--from-\w+=([\w.]+)=", command)}
    assert _secret_refs(_pod(overlay)) <= created, created
    assert {"kvmeta-auth/token", "kvmeta-auth/tokens.toml"} <= _secret_refs(_pod(overlay))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_mount_is_a_volume_of_the_pod(overlay: str) -> None:
    workload = _workload(overlay)["spec"]
    pod = workload["template"]["spec"]
    names = {v["name"] for v in pod["volumes"]}
    names |= {c["metadata"]["name"] for c in workload.get("volumeClaimTemplates", [])}
    for container in pod["containers"] + pod.get("initContainers", []):
        for mount in container["volumeMounts"]:
            assert mount["name"] in names, mount


def _local(path: str, tmp: Path) -> Path:
    return tmp / PurePosixPath(path).relative_to("/")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_tokens_file_copy_is_one_the_server_accepts(overlay: str, tmp_path: Path) -> None:
    """The Secret's file as the kubelet lays it out (group-readable with fsGroup) is refused by
    the real server; the init container's command, run here, makes the copy KVMETA_AUTH_FILE
    names, which the server loads."""
    pod = _pod(overlay)
    (init,) = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret_mount = next(m for m in init["volumeMounts"] if "secret" in volumes[m["name"]])
    secret = volumes[secret_mount["name"]]["secret"]
    (item,) = secret["items"]
    laid_out = _local(f"{secret_mount['mountPath']}/{item['path']}", tmp_path)
    laid_out.parent.mkdir(parents=True)
    product.write_tokens_file(laid_out)
    os.chmod(laid_out, secret["defaultMode"])
    with pytest.raises(ConfigError, match="readable or writable by group or others"):
        load_tokens(laid_out)

    auth_file = _env(_server(overlay))["KVMETA_AUTH_FILE"]
    copy_dir = str(PurePosixPath(auth_file).parent)
    (run_mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == copy_dir]
    assert "emptyDir" in volumes[run_mount["name"]]
    assert copy_dir in {m["mountPath"] for m in _server(overlay)["volumeMounts"]}
    _local(copy_dir, tmp_path).mkdir(parents=True)
    command = [_local(a, tmp_path).as_posix() if a.startswith("/") else a for a in init["command"]]
    assert shutil.which(command[0]), f"{command[0]} (coreutils) is in the image and here"
    subprocess.run(command, check=True, timeout=30)
    table = load_tokens(_local(auth_file, tmp_path))
    assert table is not None
