"""``benchmarks/gpu_fit.py``: a side-by-side run that cannot fit the GPU is refused before any
engine starts, with what it needs; the runs that fitted an H100 are not."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_fit  # noqa: E402

GiB = 1 << 30
H100 = int(79.2 * GiB)  # as the H100's results record it
WEIGHTS = int(9.63 * GiB)  # the benchmarks' model: Qwen3-8B's attention shape, 36 layers, bf16
TTFT_64K_KV = 11 * GiB  # gpu_ttft's KV room for a 65,537-token prompt


@pytest.mark.parametrize("modes, kv, staging, fits", [
    # ran out of memory on an H100 (2026-12-06): the four default TTFT engines up to 64k
    ("vllm-apc,kvplugin,kvplugin-server,vllm-offloading", TTFT_64K_KV, 12 * GiB, False),
    # ran on an H100: three TTFT engines with 6 GiB of KV and staging, two with 12 GiB
    ("vllm-apc,kvplugin,vllm-offloading", 6 * GiB, 6 * GiB, True),
    ("kvplugin,vllm-offloading", 12 * GiB, 12 * GiB, True),
    ("kvplugin,kvplugin-server", 6 * GiB, 6 * GiB, True),
    # three plugin engines to 32k (2026-12-06): out of memory with 6 and with 5 GiB of KV and
    # staging each (27.6 GiB per engine at 5), ran with 3 (to 16k)
    ("kvplugin,kvplugin-server,kvplugin-server-resolving", 6 * GiB, 6 * GiB, False),
    ("kvplugin,kvplugin-server,kvplugin-server-resolving", 5 * GiB, 5 * GiB, False),
    ("kvplugin,kvplugin-server,kvplugin-server-resolving", 3 * GiB, 3 * GiB, True),
    # ran on an H100 (2026-12-07): three TTFT engines with 5 GiB each, two of them the plugin's
    # (an untimed mode's engine is the same engine: its staging counts alike)
    ("vllm-apc,kvplugin,kvplugin-rehearse", 5 * GiB, 5 * GiB, True),
    ("vllm-apc,kvplugin,kvplugin-untimed", 5 * GiB, 5 * GiB, True),
    ("vllm-apc,kvplugin,kvplugin-untimed", 6 * GiB, 6 * GiB, False),
    # serving: two engines ran on an H100 (the notes name two for an H100, not the default three)
    ("baseline,kvplugin", 16 * GiB, 8 * GiB, True),
    ("baseline,kvplugin,kvplugin-server", 16 * GiB, 8 * GiB, False),
])
def test_the_h100_runs_on_record_are_classified_as_they_went(modes, kv, staging, fits):
    assert (gpu_fit.needed_bytes(modes.split(","), WEIGHTS, kv, staging) <= H100) is fits


def test_a_run_that_cannot_fit_exits_naming_what_it_needs(tmp_path, monkeypatch):
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 24)
    (tmp_path / "config.json").write_text("{}")  # not weights
    assert gpu_fit.weights_bytes(str(tmp_path)) == 1024
    monkeypatch.setattr(gpu_fit, "gpu_bytes", lambda: 20 * GiB)  # no GPU here
    with pytest.raises(SystemExit, match=r"2 engines \(baseline,kvplugin\) need ~22\.0 GiB.*8 of work space.*"
                                         r"GPU has 20\.0 GiB\. Name fewer"):
        gpu_fit.check(["baseline", "kvplugin"], str(tmp_path), 2 * GiB, 2 * GiB, "Name fewer --modes.")
    gpu_fit.check(["baseline"], str(tmp_path), 2 * GiB, 2 * GiB, "unused")  # 10 GiB: fits
