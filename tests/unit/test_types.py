"""Namespace normalisation: the stock SGLang client's enum spelling means the plain pool."""

from kvmeta._types import PoolId, normalize_namespace


def test_normalize_namespace() -> None:
    assert normalize_namespace("PoolName.KV") == "kv"
    assert normalize_namespace("PoolName.DEEPSEEK_V4_C1") == "deepseek_v4_c1"
    assert normalize_namespace("kv") == "kv"
    assert normalize_namespace("mamba") == "mamba"
    assert normalize_namespace("MyPool.X") == "MyPool.X"


def test_pool_id_names_itself_for_logs() -> None:
    assert str(PoolId("s", 3, "kv")) == "rank 3 namespace 'kv'"
    assert str(PoolId("v", 1, "")) == "vllm rank 1"
