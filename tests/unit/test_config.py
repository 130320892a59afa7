"""kv_connector_extra_config: defaults, bad keys and bad types name the key."""

from __future__ import annotations

import pytest

from vllm_kvplugin.config import FIELDS, ConfigError, KVPluginConfig, config_table_markdown


def test_defaults():
    cfg = KVPluginConfig.from_extra_config(None)
    assert cfg.chunk_size is None and cfg.cpu_bytes == 4 << 30 and cfg.server is None
    assert cfg.load_failure_policy == "fail"  # vLLM's own default: see test_fail_closed


def test_values():
    cfg = KVPluginConfig.from_extra_config({"chunk_size": 64, "cpu_bytes": 1 << 20,
                                            "server": "unix:///tmp/x.sock", "server_timeout_s": 2})
    assert (cfg.chunk_size, cfg.cpu_bytes, cfg.server, cfg.server_timeout_s) == (64, 1 << 20, "unix:///tmp/x.sock", 2)


def test_unknown_key_names_key_and_accepted():
    with pytest.raises(ConfigError, match=r"'chunksize'.*accepted keys: .*chunk_size"):
        KVPluginConfig.from_extra_config({"chunksize": 64})


@pytest.mark.parametrize("key,value,expect", [
    ("chunk_size", "256", "int"), ("chunk_size", 25.6, "int"), ("cpu_bytes", True, "int"),
    ("verify_checksums", 1, "bool"), ("server", 5, "str"),
])
def test_wrong_type_names_key_and_type(key, value, expect):
    with pytest.raises(ConfigError, match=rf"\['{key}'\] must be {expect}"):
        KVPluginConfig.from_extra_config({key: value})


@pytest.mark.parametrize("extra,match", [
    ({"chunk_size": 0}, "chunk_size"), ({"cpu_bytes": -1}, "cpu_bytes"),
    ({"load_failure_policy": "ignore"}, "load_failure_policy"), ({"server": "http://x"}, "server"),
])
def test_bad_values(extra, match):
    with pytest.raises(ConfigError, match=match):
        KVPluginConfig.from_extra_config(extra)


def test_chunk_must_be_block_multiple():
    cfg = KVPluginConfig.from_extra_config({"chunk_size": 96})
    assert cfg.resolve_chunk_size([32]) == 96
    with pytest.raises(ConfigError, match=r"multiple of every KV cache group's block size \[64\]: 64, 128"):
        cfg.resolve_chunk_size([64])
    # a hybrid model's groups: 384-token blocks (the 256 default is not valid there)
    with pytest.raises(ConfigError, match=r"\[128, 384\]: 384, 768, 1152"):
        KVPluginConfig.from_extra_config({"chunk_size": 256}).resolve_chunk_size([384, 128, 384])


@pytest.mark.parametrize("blocks,auto", [([16], 256), ([32, 32], 256), ([384], 384), ([528], 528),
                                         ([128, 384], 384), ([96], 288), ([640, 16], 640)])
def test_default_chunk_is_the_smallest_valid_from_256(blocks, auto):
    assert KVPluginConfig.from_extra_config({}).resolve_chunk_size(blocks) == auto


def test_table_lists_every_key():
    table = config_table_markdown()
    for f in FIELDS:
        assert f"`{f.key}`" in table
