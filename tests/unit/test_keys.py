"""Chunk keys: rolling over the prefix, stable, collision-free encoding, sensitive to
everything that changes KV."""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np
import pytest

from vllm_kvplugin.chunk.keys import KEY_SIZE, KeyExtras, MMItem, chunk_keys, model_fingerprint

FP = model_fingerprint({"model": "tiny", "dtype": "bfloat16"})
TOKENS = list(range(1000, 1000 + 700))


def test_only_full_chunks_get_keys():
    assert len(chunk_keys(FP, TOKENS, 256)) == 2
    assert len(chunk_keys(FP, TOKENS[:255], 256)) == 0
    assert len(chunk_keys(FP, TOKENS[:512], 256)) == 2


def test_key_names_the_whole_prefix():
    a = chunk_keys(FP, TOKENS, 128)
    changed = list(TOKENS)
    changed[5] += 1  # a token in chunk 0 changes every later key
    b = chunk_keys(FP, changed, 128)
    assert all(x != y for x, y in zip(a, b))
    changed = list(TOKENS)
    changed[300] += 1  # a token in chunk 2 keeps keys 0 and 1
    c = chunk_keys(FP, changed, 128)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:]))


@pytest.mark.parametrize("as_array", [False, True])
def test_incremental_equals_full(as_array):
    """An extension reads only the ids from its first chunk on (a lone request's lookup keys its
    first chunks, then the rest): the same keys, multimodal items across the cut included."""
    tokens = np.asarray(TOKENS, dtype=np.int32) if as_array else TOKENS
    for extras in (KeyExtras(), KeyExtras(mm=(MMItem("img-hash", offset=250, length=20),))):
        full = chunk_keys(FP, tokens, 64, extras)
        head = chunk_keys(FP, tokens[:256], 64, extras)
        tail = chunk_keys(FP, tokens, 64, extras, start_key=head[-1], start_chunk=4)
        assert head + tail == full and len(tail) == len(full) - 4 == 6
    assert chunk_keys(FP, TOKENS[:300], 64, start_key=full[-1], start_chunk=10) == []  # nothing past the ids


def test_extras_and_fingerprint_change_keys():
    base = chunk_keys(FP, TOKENS, 256)
    assert chunk_keys(model_fingerprint({"model": "other"}), TOKENS, 256)[0] != base[0]
    assert chunk_keys(FP, TOKENS, 256, KeyExtras(lora_name="adapter-a"))[0] != base[0]
    assert chunk_keys(FP, TOKENS, 256, KeyExtras(cache_salt="tenant-1"))[0] != base[0]
    mm = KeyExtras(mm=(MMItem("img-hash", offset=300, length=40),))
    with_mm = chunk_keys(FP, TOKENS, 256, mm)
    assert with_mm[0] == base[0] and with_mm[1] != base[1]  # only the chunk holding the image


def test_stable_value():
    """Keys are a documented function of their inputs (stable across versions and processes):
    SHA-256 over a versioned, length-prefixed encoding (chunk/keys.py)."""
    tokens = np.arange(16, dtype=np.int32)
    absent = b"\x00"
    root = hashlib.sha256(b"kvplugin/chunk-key/v3" + struct.pack("<I", 16) + b"\x01"
                          + struct.pack("<Q", len(FP)) + FP + b"\x01" + struct.pack("<Q", 0)
                          + absent * 3).digest()
    want = hashlib.sha256(root + struct.pack("<I", 0) + tokens.astype("<i4").tobytes()).digest()
    assert chunk_keys(FP, tokens.tolist(), 16) == [want] and len(want) == KEY_SIZE


def test_token_ids_as_list_tuple_or_array_give_one_key_and_bad_ids_are_refused():
    """A prompt's ids (vLLM: a list) give the same keys however they come; ids outside
    [0, 2**31) are refused, never wrapped into another prompt's key."""
    ids = np.random.default_rng(1).integers(0, 2**31 - 1, 1024).tolist()
    want = chunk_keys(FP, np.asarray(ids, dtype=np.int64), 256)
    assert chunk_keys(FP, ids, 256) == want == chunk_keys(FP, tuple(ids), 256)
    assert chunk_keys(FP, [np.int64(i) for i in ids], 256) == want
    for bad in ([1, -1], [2**31], np.array([1, -1]), np.array([2**31]), [1.5]):
        with pytest.raises(ValueError, match="int32"):
            chunk_keys(FP, bad, 1)


@pytest.mark.parametrize("a,b", [
    # fields joined without lengths used to run into each other
    (KeyExtras(lora_name="x\x00salt\x00y", cache_salt=""), KeyExtras(lora_name="x", cache_salt="y\x00salt\x00")),
    (KeyExtras(lora_name="ab", cache_salt="c"), KeyExtras(lora_name="a", cache_salt="bc")),
    # None was the same as ""
    (KeyExtras(cache_salt=None), KeyExtras(cache_salt="")),
    (KeyExtras(lora_name=None), KeyExtras(lora_name="")),
    # a LoRA is its name and its weights: same name, another path is another adapter
    (KeyExtras(lora_name="a", lora_path="/loras/v1"), KeyExtras(lora_name="a", lora_path="/loras/v2")),
    # multimodal identifiers with separator bytes or digits in them
    (KeyExtras(mm=(MMItem("img\x0010", 0, 8),)), KeyExtras(mm=(MMItem("img", 10, 8),))),
    (KeyExtras(mm=(MMItem("a", 0, 8), MMItem("b", 0, 8))), KeyExtras(mm=(MMItem("a", 0, 8),))),
])
def test_distinct_inputs_never_share_a_key(a, b):
    assert chunk_keys(FP, TOKENS, 256, a)[0] != chunk_keys(FP, TOKENS, 256, b)[0]


def test_namespace_and_chunk_size_change_every_key():
    base = chunk_keys(FP, TOKENS, 128)
    other = chunk_keys(FP, TOKENS, 128, namespace=b"after-a-reset")
    assert all(x != y for x, y in zip(base, other))
    assert chunk_keys(FP, TOKENS[:512], 256)[0] not in chunk_keys(FP, TOKENS[:512], 128)


def test_key_cost_for_a_million_tokens():
    """Reported, not asserted (speed is measured in benchmarks): 4,096 chunks of 256 tokens."""
    import time

    tokens = np.random.default_rng(0).integers(0, 150_000, 1 << 20, dtype=np.int32)
    t0 = time.perf_counter()
    keys = chunk_keys(FP, tokens, 256)
    print(f"keys for 1M tokens: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    assert len(keys) == 4096 and len(set(keys)) == 4096


def test_fingerprint_ignores_key_order():
    assert model_fingerprint({"a": 1, "b": {"c": 2, "d": 3}}) == model_fingerprint({"b": {"d": 3, "c": 2}, "a": 1})


def test_model_identity_ignores_incidental_config_fields():
    """Engines of different vLLM/transformers versions describe one model with different
    incidental config fields; the identity (hence every key) must not change."""
    from types import SimpleNamespace

    from vllm_kvplugin.adapters._common import model_identity

    def cfg(extra):
        hf = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_key_value_heads": 2,
              "rope_parameters": {"rope_theta": 1e4}, **extra}
        mc = SimpleNamespace(model="/m", revision=None, dtype="torch.bfloat16",
                             hf_config=SimpleNamespace(to_dict=lambda: dict(hf)))
        return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto"))

    a = model_identity(cfg({"transformers_version": "5.19", "_name_or_path": "/x", "use_cache": True}), None)
    b = model_identity(cfg({"transformers_version": "5.24", "output_attentions": False}), None)
    assert model_fingerprint(a) == model_fingerprint(b)
    c = model_identity(cfg({"num_key_value_heads": 4}), None)
    assert model_fingerprint(c) != model_fingerprint(a)
    assert model_identity(cfg({}), "shared-name")["model"] == "shared-name"


def _vllm_config(model: str, **over):
    from types import SimpleNamespace

    hf = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4}
    mc = SimpleNamespace(model=model, revision=None, dtype="torch.bfloat16", quantization=over.get("quantization"),
                         hf_config=SimpleNamespace(to_dict=lambda: dict(hf, **over.get("hf", {})),
                                                   num_hidden_layers=4))
    cc = SimpleNamespace(cache_dtype=over.get("cache_dtype", "auto"),
                         calculate_kv_scales=over.get("calculate_kv_scales", False))
    pc = SimpleNamespace(pipeline_parallel_size=over.get("pp", 1), tensor_parallel_size=1)
    return SimpleNamespace(model_config=mc, cache_config=cc, parallel_config=pc)


def test_identity_names_the_weights_dtypes_and_quantization(tmp_path):
    """A model directory whose weights changed never hits chunks of the old weights; the same
    files at another path (another machine) keep the identity when model_id names them."""
    import shutil

    from vllm_kvplugin.adapters._common import model_identity

    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (model / "config.json").write_text("{}")
    fp = lambda cfg, mid=None: model_fingerprint(model_identity(cfg, mid))  # noqa: E731
    base = fp(_vllm_config(str(model)))
    assert fp(_vllm_config(str(model))) == base
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert fp(_vllm_config(str(copy)), "shared") == fp(_vllm_config(str(model)), "shared")
    data = bytearray((model / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1  # one byte of a tensor: other weights, same size and name
    (model / "model.safetensors").write_bytes(bytes(data))
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fp(_vllm_config(str(model))) != base
    assert fp(_vllm_config(str(model)), "shared") != fp(_vllm_config(str(copy)), "shared")
    for change in ({"quantization": "fp8"}, {"cache_dtype": "fp8_e4m3"},
                   {"hf": {"quantization_config": {"quant_method": "awq", "bits": 4}}}):
        assert fp(_vllm_config(str(copy), **change)) != fp(_vllm_config(str(copy)))


def test_kv_scales_computed_at_run_time_are_refused():
    from vllm_kvplugin.adapters._common import model_identity
    from vllm_kvplugin.layout.build import LayoutError

    with pytest.raises(LayoutError, match="calculate_kv_scales"):
        model_identity(_vllm_config("/m", calculate_kv_scales=True), None)


def test_uneven_pipeline_split_is_refused(monkeypatch):
    from vllm_kvplugin.adapters._common import check_pipeline_split
    from vllm_kvplugin.layout.build import LayoutError

    check_pipeline_split(_vllm_config("/m", pp=1))
    check_pipeline_split(_vllm_config("/m", pp=2))  # 4 layers over 2 stages
    with pytest.raises(LayoutError, match="pipeline parallel size 3"):
        check_pipeline_split(_vllm_config("/m", pp=3))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    with pytest.raises(LayoutError, match="VLLM_PP_LAYER_PARTITION=3,1"):
        check_pipeline_split(_vllm_config("/m", pp=2))
