"""Chunk keys: rolling over the prefix, stable, sensitive to everything that changes KV."""

from __future__ import annotations

import numpy as np
import xxhash

from vllm_kvplugin.chunk.keys import KeyExtras, MMItem, chunk_keys, model_fingerprint

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


def test_incremental_equals_full():
    full = chunk_keys(FP, TOKENS, 64)
    head = chunk_keys(FP, TOKENS[:256], 64)
    tail = chunk_keys(FP, TOKENS, 64, start_key=head[-1], start_chunk=4)
    assert head + tail == full


def test_extras_and_fingerprint_change_keys():
    base = chunk_keys(FP, TOKENS, 256)
    assert chunk_keys(model_fingerprint({"model": "other"}), TOKENS, 256)[0] != base[0]
    assert chunk_keys(FP, TOKENS, 256, KeyExtras(lora="adapter-a"))[0] != base[0]
    assert chunk_keys(FP, TOKENS, 256, KeyExtras(cache_salt="tenant-1"))[0] != base[0]
    mm = KeyExtras(mm=(MMItem("img-hash", offset=300, length=40),))
    with_mm = chunk_keys(FP, TOKENS, 256, mm)
    assert with_mm[0] == base[0] and with_mm[1] != base[1]  # only the chunk holding the image


def test_stable_value():
    """Keys are a documented function of their inputs (stable across versions and processes)."""
    tokens = np.arange(16, dtype=np.int32)
    root = xxhash.xxh3_128()
    root.update(b"kvplugin-root\x00")
    root.update(FP)
    root.update(b"\x00lora\x00")
    root.update(b"\x00salt\x00")
    h = xxhash.xxh3_128()
    h.update(root.digest())
    h.update(tokens.astype("<i4").tobytes())
    assert chunk_keys(FP, tokens.tolist(), 16) == [h.digest()]


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
