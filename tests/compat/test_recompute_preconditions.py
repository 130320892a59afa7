"""vLLM's ``recompute`` load-failure policy is refused where vLLM's own recompute is wrong
(``connector/bad_blocks.py``): the plugin reads vLLM's resolved configuration through
``adapters/_common.py``, here from a real ``VllmConfig`` of the installed vLLM."""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

from vllm_kvplugin.adapters import _common  # noqa: E402
from vllm_kvplugin.config import ConfigError  # noqa: E402
from vllm_kvplugin.connector.bad_blocks import BadBlocks  # noqa: E402


def _vllm_config(model: str, **kw):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():  # the API lane: vLLM's source with no platform to run on
        pytest.skip("no vLLM platform here: no VllmConfig can be made (compat/api_surface.toml names the property)")

    return EngineArgs(model=model, max_model_len=1024, enforce_eager=True, **kw).create_engine_config()


@pytest.mark.parametrize("v2", [True, False])
def test_the_model_runner_in_use_is_read_from_vllm(qwen3_model, monkeypatch, v2):
    """``VLLM_USE_V2_MODEL_RUNNER`` decides vLLM's ``use_v2_model_runner``; the adapter reports it,
    and ``recompute`` with the V2 runner is a start-up error naming vLLM issue #49250.  (The
    variable is set after the configuration is made: this machine's vLLM, without Triton,
    refuses to make one for the V2 runner; the property reads it when asked.)"""
    import vllm.envs as envs

    cfg = _vllm_config(qwen3_model)
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", v2)
    assert _common.v2_model_runner(cfg) is v2
    groups = [type("G", (), {"block_size": 16})()]
    args = ("recompute", groups, _common.async_scheduling(cfg), _common.v2_model_runner(cfg))
    if v2:
        with pytest.raises(ConfigError, match=r"V1 model runner \(VLLM_USE_V2_MODEL_RUNNER=0\).*#49250"):
            BadBlocks.for_policy(*args)
    else:
        assert isinstance(BadBlocks.for_policy(*args), BadBlocks)
        assert BadBlocks.for_policy("fail", *args[1:]) is None
