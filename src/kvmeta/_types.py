"""Small shared value types; imports nothing from kvmeta so every layer may use it."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DEFAULT_NAMESPACE", "PoolId", "normalize_namespace"]

DEFAULT_NAMESPACE = "kv"

# SGLang's stock client sends ``str(PoolName.KV)``, which for its str-valued Enum is the member
# name ("PoolName.KV"), while clients up to 0.5.10 send nothing (meaning "kv") and kvmeta's
# clients send the value. The enum's values are its lower-cased member names.
_ENUM_PREFIX = "PoolName."


def normalize_namespace(namespace: str) -> str:
    """The pool name a namespace means: ``PoolName.KV`` -> ``kv``; anything else unchanged."""
    if namespace.startswith(_ENUM_PREFIX):
        return namespace[len(_ENUM_PREFIX) :].lower()
    return namespace


class PoolId(NamedTuple):
    """Names one pool. ``dialect`` keeps SGLang pools (``"s"``) and vLLM per-rank pools
    (``"v"``, namespace ``""``) apart, so the same rank numbers never collide. ``tenant`` is the
    tenant that owns it (``""``: the default tenant, which a server without a tokens file and
    the all-access ``--auth-token`` use): two tenants' pools never share a page or a key even
    with the same rank and namespace."""

    dialect: str
    rank: int
    namespace: str
    tenant: str = ""

    def __str__(self) -> str:
        owner = f"tenant '{self.tenant}' " if self.tenant else ""
        if self.dialect == "v":
            return f"{owner}vllm rank {self.rank}"
        return f"{owner}rank {self.rank} namespace '{self.namespace}'"
